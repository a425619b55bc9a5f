"""The estimator: one training step (or generation) predicted before it runs, and the decisions built on it.

Every figure here comes from one dry run of the user's own code on fake tensors that own no memory
(estimate.py); plan(), advise(), fit() and capacity() ask the same engine for each configuration they
look at, so the four answer what estimate() answers for that configuration, to the byte.

    estimate.py    estimate(): the dry run of a step (forward, loss, backward, optimizer step) and its
                   report (peak, breakdown, phases, modules, per rank)
    dispatch.py    the ledger of the dry run's storages and the dispatch mode that counts every kernel's
                   allocations and frees as the real allocator sees them
    replay.py      identical blocks (a decoder's layers) replayed in the dry run rather than run again: the
                   events of one block emitted for the next, checked against the blocks that ran
    kernels.py     the kernels' own allocations beyond their outputs: CPU probes of the real kernels,
                   CUDA's rules (cuBLAS and cuDNN workspaces, reductions' staging, fused kernels)
    allocator.py   the CUDA caching allocator's model (blocks, segments, rounding; the reference of
                   src/allocmodel.c) and the GPUs' table (memory, kernels)
    ranks.py       one process's dry run turned into every rank's figures: DDP, ZeRO-1/2/3, FSDP units
    engine.py      the search the decisions share: each configuration dry-run once, its figures as
                   estimate() reports them
    plan.py        plan(): world sizes, shardings, precisions and checkpointing that fit a device
    advise.py      advise(): what to change, in the order a user would try it, each row an estimate
    fit.py         fit(): the largest batch, sequence length or number of new tokens that fits
    capacity.py    capacity(): the most sequences generated at once on one device (a fit of generation)

memtorch.estimation, memtorch.planning, memtorch.advice and memtorch.fitting are the first names of
estimate.py, plan.py, advise.py and fit.py, kept for code that imports them (each is the same module).
Nothing is imported here: importing the package costs nothing until a call needs it.
"""
