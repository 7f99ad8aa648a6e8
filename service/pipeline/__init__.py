"""One side request from claim to terminal state: stages, usage ledger, events (SPEC §6–8)."""

from service.pipeline.failures import PipelineFailure, RequestLost, error_object
from service.pipeline.run import Outcome, PipelineDeps, run_request

__all__ = ["Outcome", "PipelineDeps", "PipelineFailure", "RequestLost", "error_object", "run_request"]
