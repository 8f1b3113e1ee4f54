"""Adapters from chunkmeta to engines and kernels; installed as ``chunkmeta.integrations``.

Each adapter imports its engine lazily, so importing this package never imports vLLM, SGLang or FLA.
"""
