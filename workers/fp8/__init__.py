"""fp8 on this device: the convention (`convention`: native e4m3 or emulated, its encoding and the
process lock), the formats and exact rounding onto their grid (`e4m3`), tensors to fp8 bytes and
back (`quantize`) and the fp8 linear layer with the model's weight quantization (`linear`).
"""
