nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl 2>&1 | tail -2
export PYTHONPATH=/tmp/site:$PWD:$PWD/kernels:$PWD/converters JAX_PLATFORMS=cuda XLA_PYTHON_CLIENT_MEM_FRACTION=0.97
TOK=16384; nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | awk '{exit !($1 < 100000)}' && TOK=8192
date -u; echo "120b tokens/step $TOK"
timeout 185 python3 benchmarks/train_throughput.py --models gpt_oss_120b --systems specjax:q_block=512 --jobs fixed_4096 --tokens-per-step $TOK --steps 3 --warmup 1 --no-sharegpt --no-profile --no-maxlen --worker-timeout-s 175 --out $OUT/g120 > $OUT/g120.log 2>&1; tail -3 $OUT/g120.log
date -u
timeout 200 python3 benchmarks/train_throughput.py --models gpt_oss_20b_bf16 --systems specjax,specforge --jobs fixed_4096 --tokens-per-step 16384 --steps 3 --warmup 1 --no-sharegpt --no-profile --no-maxlen --worker-timeout-s 90 --specforge-timeout-s 105 --out $OUT/g20 > $OUT/g20.log 2>&1; tail -3 $OUT/g20.log
date -u
timeout 150 python3 benchmarks/layer_floor.py --batch 1 --seq 4096 --formats bf16,fp8 --iters 10 --out $OUT/floor.json > $OUT/floor.log 2>&1; tail -12 $OUT/floor.log
date -u
