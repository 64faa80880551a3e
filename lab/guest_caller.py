"""Salt inside the lab guest, loaded once: `salt-call` without its 20-30 s start-up per call.

Under software emulation one `salt-call` spends most of its time starting (imports, config,
grains). This server does that once, then serves requests dropped into a directory by the host
(lab/hana_lab.py ``Lab.salt``). Each request runs the way `salt-call --local` runs it: with an
empty ``__context__``, the pillar and the modules as they are on disk now (Salt's own
``SMinion.gen_modules`` reloads both when a pillar file or a formula module changed), arguments
parsed by Salt's CLI parser and the retcode computed as salt-call computes it. The minion log
gets every record at debug level.

Protocol: ``req.N.json`` = {"args": "state.apply hana.storage test=True"} ->
``ret.N.json`` = {"local": <return>, "retcode": int, "seconds": float}. A request with
``"detach": true`` runs in a forked child and is answered at once with {"local": {"pid": N}}.
{"beacon": "once"} runs one full audit of the formula's beacon, loaded fresh over this minion's
modules (lab/guest_beacon.py).
"""

import json
import os
import shlex
import sys
import time
import traceback

import guest_beacon
import salt._logging
import salt.client
import salt.config
import salt.minion
import salt.utils.args

COMMANDS_LOG = "/run/salt/commands.tsv"  # each command a call ran, and its seconds (Lab copies it out)


def time_commands():
    """Log every command Salt runs (cmd.run_all and the rest start a TimedProc) with its wall
    time: under emulation a process costs a second or more, and this says which ones a module's
    time goes to. Only the program's name is written, never its arguments. (TimedProc, not
    cmdmod._run: the loader loads its own copy of cmdmod, which a patch here would not reach.)"""
    import salt.utils.timed_subprocess as timed_subprocess

    proc = timed_subprocess.TimedProc
    init, run = proc.__init__, proc.run

    def started(self, args, **kwargs):
        self.lab_started = time.monotonic()
        init(self, args, **kwargs)

    def ran(self):
        try:
            return run(self)
        finally:
            cmd = self.command
            name = (cmd[0] if isinstance(cmd, list | tuple) else str(cmd).split()[0]) if cmd else "?"
            with open(COMMANDS_LOG, "a") as log:
                log.write(f"{os.path.basename(str(name))}\t{time.monotonic() - self.lab_started:.3f}\n")

    proc.__init__, proc.run = started, ran


def keep_entry_points():
    """Salt lists the installed packages' entry points (salt extensions) each time it makes a
    loader, and keeps the list for 0.5 s. Over the 9p root (before the runtime disk),
    where that listing opens every package's metadata at some 25 ms a file: seconds per loader,
    a minute per state.apply. Nothing is installed into that venv while the lab runs: the list
    is kept for the caller's life (production minions read local disks: milliseconds)."""
    import salt.utils.entrypoints

    cached = salt.utils.entrypoints.iter_entry_points.__wrapped__  # functools.lru_cache'd
    cached.delta = 10**9
    cached.expiration = time.monotonic() + cached.delta


def keep_file_mappings():
    """Each of Salt's loaders (two dozen per state.apply) lists its module directories and sorts
    some two thousand file names in Python: 15 s of an apply under emulation (cProfile:
    LazyLoader._refresh_file_mapping, 48 calls), milliseconds on a real minion. A mapping is
    kept per loader setup and the mtimes of its directories, which change with any file added
    or removed (an edited file keeps its name: the mapping holds names and paths only)."""
    import salt.loader.lazy as lazy

    refresh, kept = lazy.LazyLoader._refresh_file_mapping, {}

    def mtime(path):
        try:
            return os.stat(path).st_mtime_ns
        except OSError:
            return None

    def kept_refresh(self):
        key = (
            tuple(self.module_dirs),
            tuple((mtime(d), mtime(os.path.join(d, "__pycache__"))) for d in self.module_dirs),
            tuple(self.suffix_order),
            tuple(sorted(self.suffix_map)),
            tuple(sorted(self.disabled)),
            tuple(self.static_modules),
            tuple(self.opts.get("optimization_order") or ()),
            self.opts.get("cython_enable", True),
            self.opts.get("enable_zip_modules", True),
        )
        if key not in kept:
            refresh(self)
            kept[key] = (dict(self.file_mapping), dict(self.suffix_map), list(self.suffix_order))
            return
        mapping, suffix_map, suffix_order = kept[key]
        self.file_mapping = dict(mapping)
        self.suffix_map.clear()
        self.suffix_map.update(suffix_map)
        self.suffix_order[:] = suffix_order

    lazy.LazyLoader._refresh_file_mapping = kept_refresh


def keep_template_code():
    """Salt makes a Jinja environment for each template it renders and compiles the template
    from source: every SLS file, map.jinja for each of them, the pillar's top and files, on
    every call (4-9 s of a state.apply under emulation: cProfile, Environment.compile). What
    Jinja compiles depends on the source, its names and the environment's syntax settings only,
    which Salt sets the same way for each: the code is kept per those. A new source (an edited
    file, another pillar) is a new key: compiled, never served stale."""
    import jinja2

    compile_source, kept = jinja2.Environment.compile, {}

    def kept_compile(self, source, name=None, filename=None, raw=False, defer_init=False):
        if not isinstance(source, str):  # a node tree Jinja built itself: nothing to key on
            return compile_source(self, source, name, filename, raw, defer_init)
        syntax = (
            type(self),
            self.block_start_string,
            self.block_end_string,
            self.variable_start_string,
            self.variable_end_string,
            self.comment_start_string,
            self.comment_end_string,
            self.line_statement_prefix,
            self.line_comment_prefix,
            self.trim_blocks,
            self.lstrip_blocks,
            self.newline_sequence,
            self.keep_trailing_newline,
            self.optimized,
            self.is_async,
            tuple(sorted(self.extensions)),
            self.autoescape if isinstance(self.autoescape, bool) else id(self.autoescape),
            self.finalize is not None,
        )
        key = (syntax, source, name, filename, raw, defer_init)
        if key not in kept:
            kept[key] = compile_source(self, source, name, filename, raw, defer_init)
        return kept[key]

    jinja2.Environment.compile = kept_compile


def inputs_stamp(opts):
    """Newest mtime of what a reload would read again: pillar files and the formula's modules."""
    dirs = list(opts["pillar_roots"]["base"])
    for key in ("module_dirs", "states_dirs", "utils_dirs", "beacons_dirs"):
        dirs += opts.get(key, [])
    stamps = [0]
    for directory in dirs:
        with os.scandir(directory) as entries:
            stamps += [entry.stat().st_mtime_ns for entry in entries if entry.is_file()]
    return max(stamps)


def refresh(caller, state):
    """Reload the pillar and the modules if a file they come from changed since the last call."""
    stamp = inputs_stamp(caller.opts)
    if stamp != state.get("stamp"):
        caller.sminion.opts["pillar"] = {}  # else the old pillar is merged into the new one
        caller.sminion.gen_modules(initial_load=True)
        state["stamp"] = stamp


def call(caller, line):
    """One salt-call: empty __context__, salt-call's parsing and retcode."""
    caller.sminion.functions.pack["__context__"].clear()
    fun, *cli_args = shlex.split(line)
    functions = caller.sminion.functions
    if fun not in functions:
        return {"local": f"'{fun}' is not available.", "retcode": 254}
    args, kwargs = salt.minion.load_args_and_kwargs(functions[fun], salt.utils.args.parse_input(cli_args))
    ret = functions[fun](*args, **kwargs)
    retcode = functions.pack["__context__"].get("retcode", 0)
    if retcode == 0 and isinstance(ret, dict) and not all(ret.get(k, True) for k in ("result", "success")):
        retcode = 1
    return {"local": ret, "retcode": retcode}


def detach(caller, line, spool):
    """Run the call in a forked child leading its own process group (as a minion forks a job),
    so the host can SIGKILL it with its children mid-way; returns the child's pid at once. A
    call that ends leaves its reply in ``detached.<pid>.json`` (Lab.detached_reply): why an
    apply ended before the step a test meant to kill it after."""
    pid = os.fork()
    if pid:
        return pid
    os.setsid()
    code = 1
    try:  # whatever happens, the child ends here: never back in the server's loop or its atexit
        try:
            reply = call(caller, line)
            code = reply["retcode"]
        except BaseException:  # noqa: BLE001 - SystemExit too; the traceback goes to caller.out and the reply
            reply = {"local": traceback.format_exc(), "retcode": 1}
            traceback.print_exc()
        tmp = os.path.join(spool, f"detached.{os.getpid()}.tmp")
        with open(tmp, "w") as handle:
            json.dump(reply, handle, default=repr)
        os.rename(tmp, os.path.join(spool, f"detached.{os.getpid()}.json"))
    finally:
        os._exit(code)


def reply_to(caller, request, state, children, spool):
    refresh(caller, state)
    if request.get("beacon") == "once":
        return {"local": guest_beacon.once(caller.sminion), "retcode": 0}
    if request.get("detach"):
        children.append(detach(caller, request["args"], spool))
        return {"local": {"pid": children[-1]}, "retcode": 0}
    if request.get("profile"):  # where a call's time goes, for the host to read (pstats)
        import cProfile

        profile = cProfile.Profile()
        try:
            return profile.runcall(call, caller, request["args"])
        finally:
            profile.dump_stats(request["profile"])
    return call(caller, request["args"])


def main(config_dir, spool):
    opts = salt.config.minion_config(os.path.join(config_dir, "minion"))
    opts["log_level"] = "warning"
    salt._logging.set_logging_options_dict(opts)
    salt._logging.setup_logging()
    time_commands()
    keep_entry_points()
    keep_file_mappings()
    keep_template_code()
    caller = salt.client.Caller(mopts=opts)
    with open(os.path.join(spool, "ready.tmp"), "w") as handle:
        handle.write(str(os.getpid()))
    os.rename(os.path.join(spool, "ready.tmp"), os.path.join(spool, "ready"))
    n, state, children = 0, {"stamp": inputs_stamp(caller.opts)}, []  # loaded just now
    while True:
        request = os.path.join(spool, f"req.{n}.json")
        if not os.path.exists(request):
            if os.path.exists(os.path.join(spool, "quit")):
                return
            # reap detached calls that ended (only ours: no other child is running now)
            children[:] = [pid for pid in children if os.waitpid(pid, os.WNOHANG) == (0, 0)]
            time.sleep(0.05)
            continue
        with open(request) as handle:
            request = json.load(handle)
        started = time.monotonic()
        try:
            reply = reply_to(caller, request, state, children, spool)
        except Exception:  # noqa: BLE001 - the host gets the traceback, the server keeps serving
            reply = {"local": traceback.format_exc(), "retcode": 1}
        reply["seconds"] = time.monotonic() - started
        tmp = os.path.join(spool, f"ret.{n}.tmp")
        with open(tmp, "w") as handle:
            json.dump(reply, handle, default=repr)
        os.rename(tmp, os.path.join(spool, f"ret.{n}.json"))
        n += 1


if __name__ == "__main__":
    main(*sys.argv[1:])
