"""Shoal: LLM serving on Kubernetes.

Import names are namespaced: ``shoal.runtime`` (inference server, router),
``shoal.operator`` (kopf operator), ``shoal.kernels`` (Triton kernels).
"""

__version__ = "0.1.0"
