"""Our own implementations of the decoder families teachers use, one file per family
(``llama``: Llama, Mistral, Qwen2; ``qwen3``: Qwen3 with q/k-norm), the ``registry`` from
config.json's ``architectures`` to the class, ``spec`` (the architecture facts, parsed) and
``loader`` (safetensors checkpoints, or random weights in place)."""
