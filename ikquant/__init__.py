"""ik_llama.cpp's GGUF file and number formats: type registry, GGUF I/O, quantization formats and recipes."""
