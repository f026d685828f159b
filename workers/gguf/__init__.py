"""GGUF checkpoints: llama.cpp's single-file format, read as a model directory of our own.

A `.gguf` file (or its split parts, or a directory holding them) carries the config, the
tokenizer, the chat template and the tensors, each tensor in its own type (F32, F16, BF16, the
32-element blocks Q4_0..Q8_0, the 256-element K-blocks, IQ4's non-linear grid, MXFP4). This
package reads that metadata into the Hugging Face config and tokenizer files our loader and the
router already read (`prepare`, cached by the file's header), maps GGUF tensor names to Hugging
Face's (`names`), and dequantizes each type in torch bit for bit as gguf-py does (`dequant`), or,
on a device whose rule keeps them packed (`execution`), holds the blocks in GGUF layers (`linear`,
`packed`).
The metadata side imports no torch, so the router can prepare a GGUF in a subprocess.
"""
