"""What every layer of qkv runs on: the device and its precision (bf16 only where it is fast), the
process heap, atomic file writes, loading files without running code, and the padded bf16 Linear.

Nothing here imports another part of qkv.
"""
