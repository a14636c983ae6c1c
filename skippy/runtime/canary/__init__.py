"""The certification canary's test data and oracle.

``synth``: synthetic models of every family the stage runtime claims, written by the project
itself (random weights, complete metadata, F32/F16/Q8_0/K-quant). ``oracle``: llama.cpp's
logits for them, with the settings under which our ggml engine must agree bit for bit.
Importing this package imports neither gguf-py nor llama.cpp; its modules do.
"""
