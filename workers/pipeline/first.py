"""A pipeline's first stage: the engine that serves the whole pipeline, and what it holds of the others.

Design: the first stage is a whole worker (scheduler, sampling, HTTP) whose runner sends each step
on to the next stage (workers/pipeline/runner.py) and whose engine keeps several batches in flight
(workers/pipeline/engine.py). `build_first_stage` builds them from the same pieces a single worker's
engine is built from (workers/engine/build.py), with the stages' clock, their metrics and the
recorder of what they measured (workers/pipeline/metrics.py); `FirstStage` then gathers every
stage's description for `/capability` and, once the server has stopped, stops the stages after the
last step and records their figures. Trade-off: the linear layers' state slots are handed out by
this stage's scheduler for every stage, so it counts them from the model's config rather than from
a pool it may not hold.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

from workers.contract import WorkerConfig
from workers.device.bind import BoundDevice
from workers.engine.build import BuiltEngine, CpuPaths, grammars_for, scheduler_config
from workers.engine.compiled import CompileDecision
from workers.engine.scheduler import Scheduler
from workers.engine.speculate import speculator_for
from workers.kv.pool import KVPool
from workers.model.loader import LoadedModel
from workers.pipeline.engine import PipelineEngine
from workers.pipeline.follower import describe_stage
from workers.pipeline.launch import Stages
from workers.pipeline.metrics import StageClock, StageMetrics, TimingRecorder
from workers.pipeline.runner import PipelineRunner
from workers.pipeline.transport import StageLink


@dataclass
class FirstStage:
    """The first stage's hold on its pipeline: the link, the other stages' processes, the runner
    that sends steps to them and the recorder of what they measured."""

    link: StageLink
    stages: Stages
    runner: PipelineRunner
    recorder: TimingRecorder

    def describe(self, bound: BoundDevice, loaded: LoadedModel, kernels: dict, fp8: dict, kv: KVPool) -> dict:
        """The pipeline's stages as `/workers` shows them: this one, then what each other stage reported."""
        mine = describe_stage(0, bound, loaded, kernels, fp8, kv)
        return {"stages": self.link.gather(mine), "backend": self.stages.plan.backend}

    def close(self) -> None:
        """After the server: the other stages stop after this one's last step, each reporting its
        last figures as it leaves, then what they measured is recorded for the next split."""
        with contextlib.suppress(Exception):  # a stage already gone: nothing to tell
            self.runner.stop()
        self.stages.stop()
        self.recorder.record(force=True)


def build_first_stage(config: WorkerConfig, bound: BoundDevice, loaded: LoadedModel, kv: KVPool,
                      decision: CompileDecision, cpu: CpuPaths, context: int, link: StageLink,
                      stages: Stages) -> tuple[BuiltEngine, FirstStage]:
    """The first stage's engine (several batches in flight through the stages) and its hold on them."""
    recorder: TimingRecorder | None = None
    clock = StageClock(lambda _: recorder.record(), bound.simulated or bound.type == "cpu")
    recorder = TimingRecorder(stages.plan, clock, stages.status_files())
    runner = PipelineRunner(loaded.model, kv, bound.torch_device, link, config.pipeline_microbatches, clock,
                            cpu.in_place)
    slots = config.max_batch if loaded.config.state_layers else 0  # any stage may hold linear layers
    scheduler = Scheduler(scheduler_config(config, loaded, kv, context, kv.group_shapes, slots))
    speculator = speculator_for(config.speculative, config.num_speculative_tokens, scheduler, pipeline=True)
    engine = PipelineEngine(runner, scheduler, loaded.tokenizer, max_queue=config.max_queue,
                            grammars=grammars_for(config, loaded), batches=config.pipeline_batches or link.world,
                            speculator=speculator)  # off, with the reason (`/workers` says why)
    engine.metrics.registry.register(StageMetrics(runner.clock, stages.status_files()))  # each stage's own steps
    return BuiltEngine(engine, kv, decision), FirstStage(link, stages, runner, recorder)
