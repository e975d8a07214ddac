"""Benchmarks of ``lightning_smp``: memory, traffic and step time against its peers, side by side in one run.

The same GPT-style model (:class:`lightning_smp.demo.TinyGPT`, one FSDP unit per block), the same synthetic
tokens (:class:`lightning_smp.demo.MarkovTokens`) and the same optimizer (AdamW), under:

- Lightning ``DDPStrategy``;
- Lightning ``FSDPStrategy`` with ``FULL_SHARD`` (on CPU with the one fix FSDP1 needs there: ``device_id`` as a
  device);
- plain PyTorch FSDP1 on a hand-built ``(replicate, shard)`` mesh with a hand-written loop, no Lightning: the floor
  the wrapper should not exceed;
- ``smp_hybrid`` and ``smp_hybrid_zero2`` (:class:`lightning_smp.HybridShardFSDPStrategy`) at every valid degree,
  and ``smp_hybrid`` with :class:`lightning_smp.callbacks.MemorySavingsCallback` (its overhead);
- FSDP2: plain PyTorch ``fully_shard`` on the same mesh with a hand-written loop (``torch_fsdp2``) next to
  ``smp_hybrid_fsdp2`` (the strategy with ``fsdp_version=2``) at every valid degree;
- gradient accumulation (one round: bytes and memory only) at the hybrid degree for k = 1, 2, 4: FSDP1 ``no_sync``,
  FSDP1 reducing every micro-batch and FSDP2's deferred all-reduce: bytes across replicas per optimizer step and the
  most gradient memory a rank holds.

Per configuration and rank: model-state bytes against the floor (unsharded / degree, padding shown separately),
logical bytes per optimizer step inside the shard group and across replicas against the textbook formula,
collective counts by group size, median step time over interleaved runs (A B C, C B A, ...), peak RSS. Results go to
``benchmarks/results/`` as ``quick.json``, ``quick.md`` and ``memory_by_degree.png`` (``large.*`` for ``--large``).

Quick mode (CPU, 4 forked ranks, gloo, fp32, ~1 M parameters; a few minutes on 2 cores)::

    make bench                                  # = python -m benchmarks
    python -m benchmarks --rounds 6 --steps 8   # more timed steps
    python -m benchmarks --world-size 8 --only ddp "smp_hybrid d=2" "torch_hsdp d=2"

``--large`` (GPU nodes: one process per GPU, NCCL, bf16-mixed, TinyGPT of ~1.03 B parameters, sequences of
1024 tokens); every rank runs every configuration in turn and rank 0 writes ``results/large.*``::

    # one node of 8 GPUs
    torchrun --nproc-per-node 8 -m benchmarks --large
    # two nodes (run on each node; HOST is the first node)
    torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint HOST:29500 -m benchmarks --large
    # SLURM: one torchrun per node
    srun --nodes 2 --ntasks-per-node 1 bash -c 'torchrun --nnodes $SLURM_NNODES --nproc-per-node 8 \\
        --rdzv-backend c10d --rdzv-endpoint $(scontrol show hostnames $SLURM_JOB_NODELIST | head -n1):29500 \\
        -m benchmarks --large'

Run from the repository root (``benchmarks`` is not part of the installed package).
"""

from benchmarks.settings import ConfigSpec, ModelSize, Settings, build_configs, large_settings, quick_settings

__all__ = ["ConfigSpec", "ModelSize", "Settings", "build_configs", "large_settings", "quick_settings"]
