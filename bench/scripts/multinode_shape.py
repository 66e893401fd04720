"""pytorch/examples' ``distributed/ddp-tutorial-series/multinode.py`` shape, on CPU
(issue 50's clean-ends bench): a Trainer class holding a DDP model, a DataLoader with a
DistributedSampler over a synthetic dataset, ``set_epoch`` each epoch, a snapshot every
few epochs by global rank 0, ``destroy_process_group()`` at the end of ``main``."""

import os
import sys

import torch
import torch.nn.functional as F
from torch.distributed import destroy_process_group, init_process_group
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


class MyTrainDataset(Dataset):
    def __init__(self, size):
        self.data = [(torch.rand(20), torch.randint(0, 2, (1,))) for _ in range(size)]

    def __len__(self):
        return len(self.data)

    def __getitem__(self, index):
        return self.data[index]


class Trainer:
    def __init__(self, model, train_data, optimizer, save_every, snapshot_path):
        self.global_rank = int(os.environ["RANK"])
        self.model = DDP(model)
        self.train_data = train_data
        self.optimizer = optimizer
        self.save_every = save_every
        self.epochs_run = 0
        self.snapshot_path = snapshot_path
        if os.path.exists(snapshot_path):
            snapshot = torch.load(snapshot_path)
            self.model.module.load_state_dict(snapshot["MODEL_STATE"])
            self.epochs_run = snapshot["EPOCHS_RUN"]

    def _run_batch(self, source, targets):
        self.optimizer.zero_grad()
        loss = F.cross_entropy(self.model(source), targets.squeeze(1))
        loss.backward()
        self.optimizer.step()

    def train(self, max_epochs):
        for epoch in range(self.epochs_run, max_epochs):
            self.train_data.sampler.set_epoch(epoch)
            for source, targets in self.train_data:
                self._run_batch(source, targets)
            if self.global_rank == 0 and epoch % self.save_every == 0:
                snapshot = {"MODEL_STATE": self.model.module.state_dict(), "EPOCHS_RUN": epoch}
                torch.save(snapshot, self.snapshot_path)


def main(total_epochs, save_every, snapshot_path):
    init_process_group(backend="gloo")
    dataset = MyTrainDataset(256)
    model = torch.nn.Linear(20, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    loader = DataLoader(dataset, batch_size=32, shuffle=False, sampler=DistributedSampler(dataset))
    Trainer(model, loader, optimizer, save_every, snapshot_path).train(total_epochs)
    destroy_process_group()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3])
