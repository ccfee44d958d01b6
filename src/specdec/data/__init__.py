"""The ground floor for data: the stdlib corpus and its split (corpus.py), the benchmark
prompt suite (prompts.py) and chat prompts made from local text (chat.py). Nothing here
imports the rest of specdec, so prophets, training and benchmarks all read from it."""
