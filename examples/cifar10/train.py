"""DeepSpeed's CIFAR-10 tutorial, on paratrain: change the import, keep the script.

    paratrain run --nproc-per-node 2 examples/cifar10/train.py --stage 0 --dtype fp32 --epochs 4
    paratrain run --nproc-per-node 2 examples/cifar10/train.py --data-dir ~/data   # real CIFAR-10

With no CIFAR-10 under --data-dir (nothing is downloaded here) it says how to obtain it and, unless
--no-fallback is given, trains on scikit-learn's handwritten digits instead; it prints which data it used.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

import paratrain as deepspeed  # the one-line switch: the rest is DeepSpeed's API
from paratrain.data.cifar import CLASSES as CIFAR_CLASSES
from paratrain.data.cifar import HOW_TO_GET, CifarError, load_cifar10
from paratrain.data.digits import CLASSES as DIGIT_CLASSES
from paratrain.data.digits import load_digits_as_cifar


def add_argument() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="CIFAR-10 with paratrain (DeepSpeed's tutorial)")
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--stage", type=int, default=0, choices=[0, 1, 2, 3], help="ZeRO stage")
    parser.add_argument("--dtype", default="fp32", choices=["fp32", "bf16", "fp16"])
    parser.add_argument("--data-dir", default="./data", help="folder holding CIFAR-10 (either official format)")
    parser.add_argument("--no-fallback", action="store_true", help="fail instead of using the digits dataset")
    parser.add_argument("--micro-batch", type=int, default=16)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--metrics", default=None, help="write final accuracies as JSON here (rank 0)")
    deepspeed.add_config_arguments(parser)
    return parser.parse_args()


class Net(nn.Module):
    """The tutorial's small conv net."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 6, 5)
        self.pool = nn.MaxPool2d(2, 2)
        self.conv2 = nn.Conv2d(6, 16, 5)
        self.fc1 = nn.Linear(16 * 5 * 5, 120)
        self.fc2 = nn.Linear(120, 84)
        self.fc3 = nn.Linear(84, 10)

    def forward(self, x):
        x = self.pool(F.relu(self.conv1(x)))
        x = self.pool(F.relu(self.conv2(x)))
        x = torch.flatten(x, 1)
        return self.fc3(F.relu(self.fc2(F.relu(self.fc1(x)))))


class ImageSet(torch.utils.data.Dataset):
    def __init__(self, images: torch.Tensor, labels: torch.Tensor):
        self.images = (images.float() / 255.0 - 0.5) / 0.5  # the tutorial's Normalize((0.5,)*3, (0.5,)*3)
        self.labels = labels

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i):
        return self.images[i], self.labels[i]


def load_data(args) -> tuple[ImageSet, ImageSet, tuple[str, ...], str]:
    try:
        train = load_cifar10(args.data_dir, train=True)
        test = load_cifar10(args.data_dir, train=False)
        return ImageSet(*train), ImageSet(*test), CIFAR_CLASSES, f"CIFAR-10 from {args.data_dir}"
    except CifarError as exc:
        if args.no_fallback:
            raise
        note = f"{exc}" if "no CIFAR-10" in str(exc) else f"{exc}; {HOW_TO_GET}"
        return (ImageSet(*load_digits_as_cifar(True)), ImageSet(*load_digits_as_cifar(False)), DIGIT_CLASSES,
                f"scikit-learn digits (fallback: {note})")


def ds_config(args) -> dict:
    """The tutorial's config, key for key, except two numbers that suit the small fallback data: the batch
    is given per process (--micro-batch) and the warm-up takes 50 steps instead of 1000."""
    return {
        "train_micro_batch_size_per_gpu": args.micro_batch,
        "steps_per_print": 2000,
        "optimizer": {"type": "Adam", "params": {"lr": args.lr, "betas": [0.8, 0.999], "eps": 1e-8,
                                                 "weight_decay": 3e-7}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": args.lr,
                                                     "warmup_num_steps": 50}},
        "gradient_clipping": 1.0,
        "prescale_gradients": False,
        "bf16": {"enabled": args.dtype == "bf16"},
        "fp16": {"enabled": args.dtype == "fp16", "fp16_master_weights_and_grads": False, "loss_scale": 0,
                 "loss_scale_window": 500, "hysteresis": 2, "min_loss_scale": 1, "initial_scale_power": 15},
        "wall_clock_breakdown": False,
        "zero_optimization": {"stage": args.stage, "allgather_partitions": True, "reduce_scatter": True,
                              "allgather_bucket_size": 50000000, "reduce_bucket_size": 50000000,
                              "overlap_comm": True, "contiguous_gradients": True, "cpu_offload": False},
    }


def main() -> None:
    args = add_argument()
    deepspeed.init_distributed()
    torch.manual_seed(0)
    trainset, testset, classes, used = load_data(args)
    net = Net()
    parameters = filter(lambda p: p.requires_grad, net.parameters())
    # As the tutorial: --deepspeed_config FILE wins, else the config built from --stage and --dtype.
    engine, _, trainloader, _ = deepspeed.initialize(
        args=args, model=net, model_parameters=parameters, training_data=trainset,
        config=None if args.deepspeed_config else ds_config(args))
    rank0 = engine.global_rank == 0
    dtype = torch.bfloat16 if engine.bfloat16_enabled() else torch.float16 if engine.fp16_enabled() else None
    if rank0:
        print(f"data: {used}")
        print(f"ZeRO stage {engine.zero_optimization_stage()}, bf16={engine.bfloat16_enabled()}, "
              f"fp16={engine.fp16_enabled()}")
    criterion = nn.CrossEntropyLoss()
    for epoch in range(args.epochs):
        running = 0.0
        for i, (inputs, labels) in enumerate(trainloader):
            if dtype is not None:
                inputs = inputs.to(dtype)
            loss = criterion(engine(inputs).float(), labels)
            engine.backward(loss)
            engine.step()
            running += loss.item()
            if rank0 and i % 20 == 19:
                print(f"[{epoch + 1}, {i + 1:4d}] loss: {running / 20:.3f}")
                running = 0.0
    if rank0:
        print("Finished Training")
    correct = torch.zeros(10)
    total = torch.zeros(10)
    engine.eval()
    with torch.no_grad():
        for start in range(0, len(testset), 256):
            images, labels = testset.images[start:start + 256], testset.labels[start:start + 256]
            predicted = engine(images.to(dtype) if dtype is not None else images).argmax(dim=1)
            for c in range(10):
                mask = labels == c
                total[c] += mask.sum()
                correct[c] += (predicted[mask] == c).sum()
    accuracy = float(correct.sum() / total.sum())
    if rank0:
        print(f"Accuracy of the network on the {int(total.sum())} test images: {100 * accuracy:.1f} %")
        for c, name in enumerate(classes):
            print(f"Accuracy of {name:>10s} : {100 * float(correct[c] / max(total[c], 1)):.1f} %")
        if args.metrics:
            Path(args.metrics).write_text(json.dumps({"data": used, "accuracy": accuracy, "steps": engine.global_steps,
                                                      "zero_stage": engine.zero_optimization_stage(),
                                                      "bf16": engine.bfloat16_enabled(),
                                                      "per_class": (correct / total.clamp_min(1)).tolist()}))


if __name__ == "__main__":
    main()
