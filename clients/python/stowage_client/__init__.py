"""Python client for the Stowage text-to-image inference server.

Needs the generated stubs of proto/stowage/v1/{generation,admin,config}.proto on PYTHONPATH
(importable as ``stowage.v1.generation_pb2`` and so on); they are build outputs, never committed.

Example::

    from stowage_client import StowageClient

    with StowageClient("127.0.0.1:50051", timeout=60) as client:
        result = client.generate("a lighthouse at dusk", seed=7)
        open("out.png", "wb").write(result.image)

    from stowage_client import AdminClient  # The admin API; the token defaults to $STOWAGE_TOKEN.

    with AdminClient("127.0.0.1:50051", token="...", timeout=30) as admin:
        for c in admin.get_placement().components:
            print(c.id, c.state, c.device_bytes)
"""

from stowage_client.admin import (
    AdminClient,
    ComponentPlacementInfo,
    Decision,
    DeviceStatusInfo,
    GroupOffloadInfo,
    PlacementInfo,
)
from stowage_client.client import (
    AdapterInfo,
    ComponentInfo,
    GenerationResult,
    Metadata,
    PipelineInfo,
    PartialImage,
    ProgressEvent,
    RequestStats,
    StowageClient,
    StowageError,
    make_channel,
)

__all__ = [
    "AdapterInfo",
    "AdminClient",
    "ComponentInfo",
    "ComponentPlacementInfo",
    "Decision",
    "DeviceStatusInfo",
    "GenerationResult",
    "GroupOffloadInfo",
    "Metadata",
    "PartialImage",
    "PipelineInfo",
    "PlacementInfo",
    "ProgressEvent",
    "RequestStats",
    "StowageClient",
    "StowageError",
    "make_channel",
]
