"""How much decoding untrusted bytes may cost: every decode limit of the library, in one place.

Each bound is checked in Python integers against what a header declares, before numpy, torch
or zstd allocates anything for it.
"""

from __future__ import annotations

# What a payload may decode to when the caller bounds it neither by ``max_decoded_bytes`` nor by
# ``expect_shapes``: the larger of its uncompressed body and its reconstructed tensors. A block of
# the models this project trains is tens of MB; callers with larger blocks pass their shapes.
MAX_DECODED_BYTES = 1 << 30

# Elements of one tensor, and of the strides of its shape (the product of its non-zero sizes):
# far above any block, and keeps every offset inside int64.
MAX_NUMEL = 2**40
MAX_DIMS = 64

# A real header is a few kB (about 300 bytes per tensor); the cap keeps a hostile header from
# costing seconds and hundreds of MB of JSON parsing before any other check.
MAX_HEADER_BYTES = 1 << 20

# Largest zeroth-order step log :func:`fedcybgd.protocol.seedlog.decode_seedlog` reads unless
# told otherwise (callers that know the steps and units pass ``seedlog.max_log_bytes``). An honest
# step is 16 bytes plus a bit per unit: 1,000 steps of a 30-unit block take 20 kB. Decoding costs
# about 75 times the log's size in memory at most (8 bytes per chosen unit), time linear in it.
MAX_SEEDLOG_BYTES = 1 << 20
MAX_SEEDLOG_HEADER_BYTES = 1 << 16
