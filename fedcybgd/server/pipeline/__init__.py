"""Pipeline mode, the server's side: the runner (:mod:`.runner`), the stages' schedules
(:mod:`.schedules`), the gate of the stages' replies (:mod:`.replies`) and what is kept to rebuild a
stage on a spare (:mod:`.replay`). The cut both sides agree on is :mod:`fedcybgd.protocol.pipeline`;
the stage's side is :mod:`fedcybgd.client.pipeline`.
"""

from fedcybgd.server.pipeline.runner import run_pipeline_server

__all__ = ["run_pipeline_server"]
