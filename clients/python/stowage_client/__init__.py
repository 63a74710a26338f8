"""Python client for the Stowage text-to-image inference server.

Needs the generated stubs of proto/stowage/v1/generation.proto on PYTHONPATH (importable as
``stowage.v1.generation_pb2``); they are build outputs, never committed.

Example::

    from stowage_client import StowageClient

    with StowageClient("127.0.0.1:50051", timeout=60) as client:
        result = client.generate("a lighthouse at dusk", seed=7)
        open("out.png", "wb").write(result.image)
"""

from stowage_client.client import (
    ComponentInfo,
    GenerationResult,
    Metadata,
    PipelineInfo,
    ProgressEvent,
    RequestStats,
    StowageClient,
    StowageError,
)

__all__ = [
    "ComponentInfo",
    "GenerationResult",
    "Metadata",
    "PipelineInfo",
    "ProgressEvent",
    "RequestStats",
    "StowageClient",
    "StowageError",
]
