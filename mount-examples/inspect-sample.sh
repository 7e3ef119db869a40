#!/usr/bin/env bash
# Main job (for now): build ucpfs, write a sample checkpoint file with real torch
# (Debian's python3-torch at /usr/bin/python3), and inspect it without loading tensor data.
. "$(dirname "$0")/common.sh" inspect
/usr/bin/python3 - "$work/sample.pt" <<'PY'
import collections, sys, torch
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Embedding(100, 16), torch.nn.Linear(16, 32),
                            torch.nn.LayerNorm(32), torch.nn.Linear(32, 100, bias=False))
opt = torch.optim.Adam(model.parameters(), lr=1e-3)
model(torch.randint(0, 100, (4, 8))).sum().backward()
opt.step()
sd = {"model": model.to(torch.bfloat16).state_dict(), "optimizer": opt.state_dict(),
      "iteration": 1, "tied_view": model[0].weight[:4, ::2]}
torch.save(sd, sys.argv[1])
PY
echo "== ucpfs inspect $work/sample.pt"
build/cli/ucpfs inspect "$work/sample.pt"
echo
echo "== ucpfs inspect --json (first tensors)"
build/cli/ucpfs inspect --json "$work/sample.pt" > "$work/sample.json"
head -n 24 "$work/sample.json"   # (not a pipe: with pipefail, head closing early is a SIGPIPE)
