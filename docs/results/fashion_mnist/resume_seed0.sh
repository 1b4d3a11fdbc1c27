#!/bin/sh
# At 22:24, with the machine's load at ~14 on 2 cores, epoch 1 of 6 took 12-18 minutes: both runs were
# stopped after epoch 1 and resumed with train.epochs=4. The warmup lasts exactly epoch 1 and the
# cosine starts at 1.0 whatever the total, so this equals a fresh 4-epoch run bit for bit.
cd /work/main
COMMON="--set model.embed_dim=64 --set model.num_heads=4 --set data.train_subset=15000 --set train.epochs=4 --set train.batch_size=64 --set optim.lr=1e-3 --set optim.warmup_epochs=1 --set train.threads=1 --set train.device=cpu"
nohup .venv/bin/python -m attnzoo train configs/vit_fashion_mnist.yaml $COMMON --out-dir runs/real/vit_fashion_mnist --resume >> runs/real/vit.log 2>&1 &
echo $! > runs/real/vit.pid
nohup .venv/bin/python -m attnzoo train configs/otvit_fashion_mnist.yaml $COMMON --set model.ot_backend=reference --out-dir runs/real/otvit_fashion_mnist --resume >> runs/real/otvit.log 2>&1 &
echo $! > runs/real/otvit.pid
