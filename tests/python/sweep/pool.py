"""Every type in a process of its own: sweep(archs) runs check_arch of each in a process forked
from a server that imported torch and transformers once, with a timeout, so that a crash or
a hang is a FAILED row."""
import time

import torch

from .run import _short, check_arch, new_row


def _worker(arch, conn, threads):
    torch.set_num_threads(threads)
    try:
        import warnings
        import transformers
        warnings.filterwarnings("ignore")
        transformers.logging.set_verbosity_error()
        row = check_arch(arch)
    except BaseException as e:  # noqa: BLE001
        row = dict(new_row(arch), outcome=f"FAILED: worker {_short(e)}")
    conn.send(row)
    conn.close()


def sweep(archs, jobs=1, timeout=300, threads=1, log=None):
    """Run check_arch for each arch in a process of its own (at most `jobs` at once);
    a crash or a timeout is a FAILED row. Returns the rows in the order of `archs`."""
    import multiprocessing as mp
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "transformers", "transformers.modeling_utils", "attnstash.install",
                                "attnstash.ops", "sweep.run", __name__])
    pending, running, rows = list(archs), {}, {}  # running: arch -> (process, conn, start)
    while pending or running:
        while pending and len(running) < jobs:
            arch = pending.pop(0)
            parent, child = ctx.Pipe(duplex=False)
            proc = ctx.Process(target=_worker, args=(arch, child, threads), daemon=True)
            proc.start()
            child.close()
            running[arch] = (proc, parent, time.time())
        time.sleep(0.05)
        for arch, (proc, conn, start) in list(running.items()):
            row = None
            if conn.poll():
                try:
                    row = conn.recv()
                except EOFError:
                    row = None
                proc.join(30)
                if row is None:
                    row = _dead_row(arch, proc, start)
            elif not proc.is_alive():
                proc.join()
                row = _dead_row(arch, proc, start)
            elif time.time() - start > timeout:
                proc.kill()
                proc.join()
                row = dict(new_row(arch), outcome=f"FAILED: timed out after {timeout} s")
            if row is not None:
                if proc.is_alive():
                    proc.kill()
                    proc.join()
                conn.close()
                if row.get("seconds") is None:
                    row["seconds"] = round(time.time() - start, 1)
                rows[arch] = row
                del running[arch]
                if log:
                    log(row)
    return [rows[a] for a in archs]


def _dead_row(arch, proc, start):
    code = proc.exitcode
    how = f"killed by signal {-code}" if code is not None and code < 0 else f"exited with status {code}"
    return dict(new_row(arch), outcome=f"FAILED: the process crashed ({how})", seconds=round(time.time() - start, 1))
