"""Messages between the server's processes, serialised with msgpack (no pickle)."""

from .codec import decode, encode, register_message
from .messages import (
    AbortMsg,
    AcceptedMsg,
    BatchMsg,
    DecodedMsg,
    DecodeMsg,
    EncodedMsg,
    EncodeMsg,
    ErrorMsg,
    FlushCacheMsg,
    FlushCacheReply,
    OutputMsg,
    StatsMsg,
    TokenizeMsg,
    TokenMsg,
    UserMsg,
)

__all__ = [
    "AbortMsg",
    "AcceptedMsg",
    "BatchMsg",
    "DecodeMsg",
    "DecodedMsg",
    "EncodeMsg",
    "EncodedMsg",
    "ErrorMsg",
    "FlushCacheMsg",
    "FlushCacheReply",
    "OutputMsg",
    "StatsMsg",
    "TokenMsg",
    "TokenizeMsg",
    "UserMsg",
    "decode",
    "encode",
    "register_message",
]
