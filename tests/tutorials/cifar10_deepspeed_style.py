"""DeepSpeed's CIFAR-10 tutorial (DeepSpeedExamples training/cifar/cifar10_deepspeed.py) as its users
write it: flags through deepspeed.add_config_arguments, deepspeed.init_distributed(), the tutorial's
LeNet, its config dict with the tutorial's keys and values, deepspeed.initialize(args=..., model=...,
model_parameters=..., training_data=..., config=...), the accelerator's device for the inputs, and the
model_engine(inputs) / backward / step loop. What differs from the tutorial: the two imports below and
the data (CIFAR-shaped synthetic images whose class is the brightest of 10 fixed colour patterns: no
download; a network that learns it lowers its loss).

    torchrun --nproc_per_node 2 tests/tutorials/cifar10_deepspeed_style.py --stage 2 --dtype bf16
"""

import argparse
import json

import torch
import torch.nn as nn
import torch.nn.functional as F

import megazero as deepspeed  # the tutorial: import deepspeed
from megazero.accelerator import get_accelerator  # the tutorial: from deepspeed.accelerator import ...


def add_argument():
    parser = argparse.ArgumentParser(description="CIFAR")
    parser.add_argument("--epochs", default=1, type=int)
    parser.add_argument("--local_rank", type=int, default=-1, help="local rank passed from distributed launcher")
    parser.add_argument("--log-interval", type=int, default=10)
    parser.add_argument("--dtype", default="fp16", type=str, choices=["bf16", "fp16", "fp32"])
    parser.add_argument("--stage", default=0, type=int, choices=[0, 1, 2, 3])
    parser.add_argument("--samples", default=1024, type=int, help="synthetic images in the training set")
    parser = deepspeed.add_config_arguments(parser)
    return parser.parse_args()


class SyntheticCIFAR10(torch.utils.data.Dataset):
    """(3 x 32 x 32 image in [-1, 1], label) pairs like torchvision's CIFAR10 after its Normalize:
    noise plus the label's colour pattern, so the class is learnable."""

    def __init__(self, samples: int, seed: int = 0):
        generator = torch.Generator().manual_seed(seed)
        self.patterns = torch.randn(10, 3, 32, 32, generator=generator)
        self.labels = torch.randint(0, 10, (samples,), generator=generator)
        self.noise = torch.randn(samples, 3, 32, 32, generator=generator)

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int):
        label = int(self.labels[index])
        return torch.tanh(0.5 * self.noise[index] + self.patterns[label]), label


def get_ds_config(args):
    """The tutorial's config dict, keys and values as it has them."""
    return {
        "train_batch_size": 16,
        "steps_per_print": 2000,
        "optimizer": {"type": "Adam", "params": {"lr": 0.001, "betas": [0.8, 0.999], "eps": 1e-8,
                                                 "weight_decay": 3e-7}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 0.001,
                                                     "warmup_num_steps": 1000}},
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


class Net(nn.Module):
    """The tutorial's LeNet: two convolutions with max pooling, three linear layers."""

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
        x = F.relu(self.fc1(x))
        x = F.relu(self.fc2(x))
        return self.fc3(x)


def main(args):
    deepspeed.init_distributed()
    torch.manual_seed(0)
    trainset = SyntheticCIFAR10(args.samples)
    net = Net()
    parameters = filter(lambda p: p.requires_grad, net.parameters())
    model_engine, optimizer, trainloader, __ = deepspeed.initialize(
        args=args, model=net, model_parameters=parameters, training_data=trainset, config=get_ds_config(args))

    local_device = get_accelerator().device_name(model_engine.local_rank)
    local_rank = model_engine.local_rank
    target_dtype = None
    if model_engine.bfloat16_enabled():
        target_dtype = torch.bfloat16
    elif model_engine.fp16_enabled():
        target_dtype = torch.half

    criterion = nn.CrossEntropyLoss()
    losses = []
    for epoch in range(args.epochs):
        running_loss = 0.0
        for i, data in enumerate(trainloader):
            inputs, labels = data[0].to(local_device), data[1].to(local_device)
            if target_dtype is not None:
                inputs = inputs.to(target_dtype)
            outputs = model_engine(inputs)
            loss = criterion(outputs, labels)
            model_engine.backward(loss)
            model_engine.step()
            losses.append(loss.item())
            running_loss += loss.item()
            if local_rank == 0 and i % args.log_interval == args.log_interval - 1:
                print(f"[{epoch + 1 : d}, {i + 1 : 5d}] loss: {running_loss / args.log_interval : .3f}", flush=True)
                running_loss = 0.0
    if local_rank == 0:
        print("Finished Training")
        print("LOSSES " + json.dumps(losses), flush=True)


if __name__ == "__main__":
    main(add_argument())
