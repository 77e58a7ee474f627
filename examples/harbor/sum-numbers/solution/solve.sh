#!/bin/bash
# The reference solution (the oracle): never shown to the policy.
set -e
cd /app
python3 -c "print(sum(int(x) for x in open('numbers.txt').read().split()))" > answer.txt
