#!/bin/bash
# Harbor's verifier contract: write the reward to /logs/verifier/reward.txt (1 = solved, 0 = not).
mkdir -p /logs/verifier
if python3 /tests/test_outputs.py; then
  echo 1 > /logs/verifier/reward.txt
else
  echo 0 > /logs/verifier/reward.txt
fi
