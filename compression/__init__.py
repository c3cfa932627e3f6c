"""compression: codecs for every tensor that crosses the network (no networking here).

Map of the package:
- ``errors.py``: ``CodecError``, the one exception decoding raises on bad bytes.
- ``header.py``: the binary header (magic, version, codec, dtype, shape, params) and its validation.
- ``base.py``: the ``Codec`` interface and the helpers every codec shares.
- ``floating.py``: ``none`` (bit-exact, any dtype), ``fp16``, ``bf16``.
- ``quantization.py``: ``int8`` (per row), ``blockwise8`` (mu-law code), ``blockwise4`` (two per byte).
- ``lowrank.py``: rank-r factors by warm-started power iteration.
- ``feedback.py``: error feedback, a wrapper for any lossy codec, per stream.
- ``streams.py``: bounded per-stream state (LRU) behind error feedback and warm starts.
- ``registry.py``: ``get_codec`` (spec strings), ``decode_any``, ``available_codecs``.

Usage::

    codec = get_codec("blockwise8:block=256")
    data = codec.encode(activations, stream=(peer_id, stage, "act"))
    tensor = decode_any(data, max_decoded_bytes=256 << 20)   # CodecError on bad bytes
"""

from compression.base import Codec, Param
from compression.errors import CodecError
from compression.feedback import ErrorFeedback
from compression.floating import BFloat16Codec, Float16Codec, NoneCodec
from compression.header import DEFAULT_MAX_DECODED_BYTES, header_info
from compression.lowrank import LowRankCodec
from compression.quantization import Blockwise4Codec, Blockwise8Codec, Int8Codec
from compression.registry import available_codecs, codec_params, decode_any, get_codec, parse_spec
from compression.streams import StreamStates

__all__ = [
    "CodecError",
    "Codec",
    "Param",
    "get_codec",
    "decode_any",
    "available_codecs",
    "codec_params",
    "parse_spec",
    "header_info",
    "DEFAULT_MAX_DECODED_BYTES",
    "ErrorFeedback",
    "StreamStates",
    "NoneCodec",
    "Float16Codec",
    "BFloat16Codec",
    "Int8Codec",
    "Blockwise8Codec",
    "Blockwise4Codec",
    "LowRankCodec",
]
