#!/bin/sh
# A third seed of the same reduced run (fresh 4-epoch runs), to see the seed-to-seed spread.
cd /work/main
COMMON="--set model.embed_dim=64 --set model.num_heads=4 --set data.train_subset=15000 --set train.epochs=4 --set train.batch_size=64 --set optim.lr=1e-3 --set optim.warmup_epochs=1 --set train.threads=1 --set train.device=cpu --set train.seed=2"
nohup .venv/bin/python -m attnzoo train configs/vit_fashion_mnist.yaml $COMMON --out-dir runs/real/vit_fashion_mnist_seed2 > runs/real/vit_seed2.log 2>&1 &
echo $! > runs/real/vit_seed2.pid
nohup .venv/bin/python -m attnzoo train configs/otvit_fashion_mnist.yaml $COMMON --set model.ot_backend=reference --out-dir runs/real/otvit_fashion_mnist_seed2 > runs/real/otvit_seed2.log 2>&1 &
echo $! > runs/real/otvit_seed2.pid
