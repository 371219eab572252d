"""jaxflash.sync: learner -> generator weight transfer, stamped with policy versions."""

from jaxflash.sync.publish import Publisher, VersionedParams, check_version, publish

__all__ = ["Publisher", "VersionedParams", "check_version", "publish"]
