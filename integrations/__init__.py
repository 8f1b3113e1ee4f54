"""Adapters from chunkmeta to engines and kernels; installed as ``chunkmeta.integrations``.

``fla`` (FLA's KDA/GDN forwards and the one ``FlaRouter``; ``kda`` re-exports it), ``vllm`` and
``sglang`` (the engine adapters), and ``plugin`` (what both engine plugins share: opt-in, version
gate, reversible patches, import hooks). Each adapter imports its engine lazily, so importing this
package never imports vLLM, SGLang or FLA.
"""
