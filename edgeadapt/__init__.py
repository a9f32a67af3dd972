"""edgeadapt: adapt biosignal models on the device that wears them.

Sub-packages:
    edgeadapt.export    torch -> ONNX training bundle with sparse-update masks (needs torch).
    edgeadapt.runtime   torch-free on-device runner (numpy + onnxruntime-training).
    edgeadapt.datasets  biosignal datasets: synthetic multi-subject generator, real data, loaders.
"""

__version__ = "0.1.0"
__all__ = ["__version__"]
