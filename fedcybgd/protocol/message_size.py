"""What a Flower message costs on the wire: the bytes of its serialised objects.

Flower (1.42) moves a message as a tree of objects (the message with its metadata, its
RecordDict, every record, every array and its chunks), each serialised once with a small header
and pulled by the node or pushed by it. The sum of those serialisations is what crosses the
wire for that message, metadata and config records included, whatever carries the payload
(FedCyBGD's encoded blocks, FedAvg's plain arrays). Both strategies count their traffic with
:func:`message_bytes`, so their figures compare.

The run, node and task ids in a message's metadata are random integers that Flower draws per
run, and protobuf writes an integer in as few bytes as it takes: the same message is a few bytes
longer or shorter from one run to the next. So the message object itself is counted with every
id at its widest (ten bytes, the largest 64-bit value): the figure is the same for the same seed
whatever ids Flower draws, and is at most about 45 bytes a message above what was sent.
"""

from __future__ import annotations

from flwr.app import Message
from flwr.common.serde_utils import error_to_proto, metadata_to_proto
from flwr.proto.message_pb2 import Message as ProtoMessage
from flwr.supercore.inflatable.inflatable_object import (
    add_header_to_object_body,
    get_all_nested_objects,
)

WIDEST = 2**64 - 1  # ten bytes as a protobuf varint
IDS = ("run_id", "src_node_id", "dst_node_id", "src_task_id", "dst_task_id")


def message_bytes(message: Message) -> int:
    """Serialised bytes of ``message``: each object of its tree once (as Flower sends it), the
    message object's ids counted at their widest (:func:`message_object_bytes`)."""
    return sum(message_object_bytes(obj) if isinstance(obj, Message) else len(obj.deflate())
               for obj in get_all_nested_objects(message).values())


def message_object_bytes(message: Message) -> int:
    """The bytes of the message object itself (its metadata, its error, the id of its content),
    as :meth:`flwr.app.Message.deflate` writes them, with every id that is set at its widest."""
    metadata = metadata_to_proto(message.metadata)
    metadata.message_id = ""  # not part of the object (Flower derives it from the object)
    for name in IDS:
        if getattr(metadata, name):
            setattr(metadata, name, WIDEST)
    body = ProtoMessage(
        metadata=metadata, content=None,
        error=error_to_proto(message.error) if message.has_error() else None,
    ).SerializeToString(deterministic=True)
    return len(add_header_to_object_body(object_body=body, obj=message))
