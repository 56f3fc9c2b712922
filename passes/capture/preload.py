"""What a rank's first capture or symbolic fake run would import, imported ahead of time.

A job that starts its ranks from a fork server (:func:`runtime.dist.launch.spawn`) lists this
module in :func:`runtime.dist.launch.preload`: the fork server imports it once and every rank
starts with it loaded. The first symbolic shape guard of a process otherwise imports dynamo's
guard, inductor's size and export's tracing modules (torch lists their files, once per process, as
frames to skip in its guard messages), seconds of CPU in every rank of a busy machine.
"""
from torch.fx.experimental.symbolic_shapes import uninteresting_files

uninteresting_files()  # imports those modules and caches the list (functools.lru_cache)
