"""`paratrain run`: start N processes per node through torchrun (torch.distributed.run)."""

from paratrain.launcher.run import LaunchOptions, add_launch_arguments, launch, torchrun_argv

__all__ = ["LaunchOptions", "add_launch_arguments", "launch", "torchrun_argv"]
