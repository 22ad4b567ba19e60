"""What a Flower message costs on the wire: the bytes of its serialised objects.

Flower (1.42) moves a message as a tree of objects (the message with its metadata, its
RecordDict, every record, every array and its chunks), each serialised once with a small header
and pulled by the node or pushed by it. The sum of those serialisations is what crosses the
wire for that message, metadata and config records included, whatever carries the payload
(FedCyBGD's encoded blocks, FedAvg's plain arrays). Both strategies count their traffic with
:func:`message_bytes`, so their figures compare.
"""

from __future__ import annotations

from flwr.app import Message
from flwr.supercore.inflatable.inflatable_object import get_all_nested_objects


def message_bytes(message: Message) -> int:
    """Serialised bytes of ``message``: each object of its tree once (as Flower sends it)."""
    return sum(len(obj.deflate()) for obj in get_all_nested_objects(message).values())
