"""How a model is split over GPUs, a part of ``config.Config`` (its base class): the
tensor-parallel size, its row parts, how its ranks split the expert layers, the pipeline stages,
and the nodes (hosts) the ranks are spread over (``engine.remote_ranks``)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field, model_validator


class ParallelSettings(BaseModel):
    tensor_parallel_size: int = Field(
        1, ge=1, description="Split the model over this many GPUs of one host (one worker process per GPU); "
                             "it must divide the attention heads. On the CPU: gloo processes (tests).")
    pipeline_parallel_size: int = Field(
        1, ge=1, description="Split the model's layers over this many pipeline stages (vLLM's flag), each stage "
                             "tensor_parallel_size GPUs of one host: a replica takes pipeline x tensor GPUs. Stage 0 "
                             "embeds, the last stage scores; the hidden states pass between stages once per step. "
                             "On the CPU: gloo processes (tests).")
    tp_comm_parts: int = Field(
        1, ge=1, le=16, description="Tensor parallel: make the o and the dense MLPs' down projections in this many "
                                   "row parts, each part's all-reduce running while the next part's GEMM does (parts "
                                   "of at least 1024 rows). 1: one GEMM, then one all-reduce. Deterministic mode uses "
                                   "1.")
    moe_parallel: Literal["tensor", "expert"] = Field(
        "tensor", description="How the tensor_parallel_size ranks split the expert layers: tensor (each expert's "
                              "intermediate dimension, as the dense MLP) or expert (E / size whole experts per rank, "
                              "their GEMMs at full width; the size must divide the expert count; vLLM's "
                              "--enable-expert-parallel). Attention stays tensor parallel (docs/scaling.md).")

    nnodes: int = Field(
        1, ge=1, description="Spread one model's ranks (pipeline x tensor parallel) over this many hosts, each holding "
                             "world / nnodes of them, node-major (node n: global ranks [n G, (n + 1) G)); node 0 "
                             "runs `teacher-server serve` (HTTP), the others `teacher-server worker` "
                             "(docs/scaling.md).")
    node_rank: int = Field(
        0, ge=0, description="This host's place among the nnodes: 0 is the leader (serve), 1..nnodes-1 run "
                             "`teacher-server worker`.")
    master_addr: str = Field(
        "127.0.0.1", description="The leader's address as the other nodes reach it (nnodes > 1): its control "
                                 "listener and the process group's rendezvous.")
    master_port: int = Field(
        29500, ge=1, le=65535, description="The leader's control port (nnodes > 1): the worker nodes' ranks connect "
                                           "here first.")
    node_authkey: str | None = Field(
        None, description="The shared secret the nodes prove to each other on the control connection (nnodes > 1; "
                          "required there). Set it through TEACHER_SERVER_NODE_AUTHKEY rather than a flag.")

    @model_validator(mode="after")
    def _check_nodes(self) -> ParallelSettings:
        world = self.ranks_per_replica()
        if world % self.nnodes:
            raise ValueError(f"nnodes={self.nnodes} does not divide the {world} ranks (pipeline_parallel_size="
                             f"{self.pipeline_parallel_size} x tensor_parallel_size={self.tensor_parallel_size}): "
                             f"each node holds world / nnodes of them")
        if self.node_rank >= self.nnodes:
            raise ValueError(f"node_rank={self.node_rank} must be below nnodes={self.nnodes}")
        if self.nnodes > 1 and ":" in self.master_addr:
            raise ValueError(f"master_addr={self.master_addr[:60]} holds a ':': an IPv6 address (the nodes' "
                             f"control connection is IPv4: give the leader's IPv4 address or a name that has one) or "
                             f"a port (give it as master_port)")
        return self

    def ranks_per_node(self) -> int:
        """The ranks (GPUs) each node holds: world / nnodes."""
        return self.ranks_per_replica() // self.nnodes

    def ranks_per_replica(self) -> int:
        """The processes (GPUs) one replica's engine takes: tensor x pipeline parallel size."""
        return self.tensor_parallel_size * self.pipeline_parallel_size
