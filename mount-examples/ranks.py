"""Starts the processes of a multi-process example job (imported by the *_job.py files).

save_or_resume(doc, save, resume, ...): the command line `CMD PATH OUT --ranks N` of a job with a
save and a resume step (CMD save or resume), launched as below with the rendezvous OUT/rendezvous-CMD.

launch(fn, n, rendezvous, a) runs fn(rank, a, rendezvous) in n processes and returns when all have
finished; if one fails, the others are stopped and its error is raised. The processes are forked,
not spawned, so they start with torch (and DeepSpeed or megatron-core) already imported: seconds
saved per rank. `rendezvous` is the file of the gloo process group's file:// rendezvous
(init_process_group(init_method="file://" + rendezvous)): a path in the job's work directory,
removed before the start (a file left by a failed job would hang this one) and after the end.
"""
import argparse
import os

import torch.multiprocessing as mp


def launch(fn, n, rendezvous, a):
    if os.path.exists(rendezvous):
        os.remove(rendezvous)
    mp.start_processes(fn, args=(a, rendezvous), nprocs=n, join=True, start_method="fork")
    if os.path.exists(rendezvous):
        os.remove(rendezvous)


def save_or_resume(doc, save, resume, path_help, out_help):
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("cmd", choices=["save", "resume"])
    ap.add_argument("path", help=path_help)
    ap.add_argument("out", help=out_help)
    ap.add_argument("--ranks", type=int, required=True)
    a = ap.parse_args()
    launch(save if a.cmd == "save" else resume, a.ranks, os.path.join(a.out, f"rendezvous-{a.cmd}"), a)
