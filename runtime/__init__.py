"""The runtime: executes rank programs (:class:`passes.ir.program.RankProgram`) on gloo or NCCL.

It runs no pass and captures nothing; what it shares with the compiler comes from :mod:`passes.ir`.
Importing it registers the real kernels of our custom ops (:mod:`runtime.kernels`).
"""
import runtime.kernels  # noqa: F401
