#!/bin/sh
# The reduced CPU run recorded in docs/training.md (one thread each, side by side).
cd /work/main
COMMON="--set model.embed_dim=64 --set model.num_heads=4 --set data.train_subset=15000 --set train.epochs=6 --set train.batch_size=64 --set optim.lr=1e-3 --set optim.warmup_epochs=1 --set train.threads=1 --set train.device=cpu"
nohup .venv/bin/python -m attnzoo train configs/vit_fashion_mnist.yaml $COMMON --out-dir runs/real/vit_fashion_mnist > runs/real/vit.log 2>&1 &
echo $! > runs/real/vit.pid
nohup .venv/bin/python -m attnzoo train configs/otvit_fashion_mnist.yaml $COMMON --set model.ot_backend=reference --out-dir runs/real/otvit_fashion_mnist > runs/real/otvit.log 2>&1 &
echo $! > runs/real/otvit.pid
