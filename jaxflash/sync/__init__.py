"""jaxflash.sync: learner -> generator weight transfer, stamped with policy versions.

In one program: ``publish`` (device to device onto a generation mesh). Across
programs: ``WeightSender`` / ``WeightReceiver`` (``jax.experimental.transfer`` or
a host-staged stream), with layouts checked on both ends first.
"""

from jaxflash.sync.publish import Publisher, VersionedParams, check_version, publish
from jaxflash.sync.transfer_layout import (
    LayoutMismatchError,
    TreeLayout,
    check_receivable,
    layout_of,
    stage_for_layout,
)
from jaxflash.sync.transfer_receiver import WeightReceiver
from jaxflash.sync.transfer_sender import WeightSender
from jaxflash.sync.transfer_wire import TransferError, TransferErrorKind

__all__ = [
    "LayoutMismatchError",
    "Publisher",
    "TransferError",
    "TransferErrorKind",
    "TreeLayout",
    "VersionedParams",
    "WeightReceiver",
    "WeightSender",
    "check_receivable",
    "check_version",
    "layout_of",
    "publish",
    "stage_for_layout",
]
