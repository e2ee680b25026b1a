# Run by the chosen interpreter before any GPU work (`python -c <this> MODULE`): what the runner needs
# to embed this same interpreter, and the checks of MODULE that need no torch. Prints one JSON
# object: {"error": ...} or the facts.
import ast
import importlib.util
import json
import os
import sys
import sysconfig

MIN_VERSION = (3, 9)

CONTRACT = ("a Python submission defines build_layer(weights, kv_cache, cfg, max_seq_len) -> handle and "
            "layer_step(handle, x, pos) -> x_out (docs/task.md, and submission/examples/python/)")

# Values no call can be made on: a name bound to one is no function, whatever else the module does.
NEVER_CALLABLE = {ast.List: "list", ast.ListComp: "list", ast.Tuple: "tuple", ast.Dict: "dict", ast.DictComp: "dict",
                  ast.Set: "set", ast.SetComp: "set", ast.JoinedStr: "str", ast.GeneratorExp: "generator"}


def fail(message):
    print(json.dumps({"error": message}))
    sys.exit(0)


def library():
    var = sysconfig.get_config_var
    if not var("Py_ENABLE_SHARED"):
        fail(f"{sys.executable} has no shared libpython (it was built without --enable-shared), and the grader "
             "embeds the interpreter through it: use a Python built with it (pyenv: PYTHON_CONFIGURE_OPTS="
             "--enable-shared), e.g. your distribution's python3")
    folders = [var("LIBDIR"), var("LIBPL"), os.path.join(sys.base_prefix, "lib")]
    names = [var("LDLIBRARY"), var("INSTSONAME")]
    for folder in filter(None, folders):
        for name in filter(None, names):
            path = os.path.join(folder, name)
            if not name.endswith(".a") and os.path.isfile(path):
                return path
    fail(f"{sys.executable} reports a shared libpython ({', '.join(filter(None, names))}) but it is in none of "
         f"{', '.join(filter(None, folders))}")


def defined_at_top(tree):
    """Each name the module binds at its top level, to None where its last binding may be a function (a def, a
    class, an import, any other expression), else to (line, type) of the value that never is one."""
    names = {}
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names[node.name] = None
        elif isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None:
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            value = node.value
            kind = type(value.value).__name__ if isinstance(value, ast.Constant) else NEVER_CALLABLE.get(type(value))
            names.update((t.id, (node.lineno, kind) if kind else None) for t in targets if isinstance(t, ast.Name))
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update(((a.asname or a.name).split(".")[0], None) for a in node.names)
    return names


def check_module(path):
    try:
        with open(path, encoding="utf-8") as f:
            source = f.read()
    except (OSError, UnicodeDecodeError) as e:
        fail(f"cannot read the submission {path}: {e}")
    try:
        tree = ast.parse(source, path)
    except SyntaxError as e:
        fail(f"{path}:{e.lineno}: {type(e).__name__}: {e.msg}")
    defined = defined_at_top(tree)
    missing = [f for f in ("build_layer", "layer_step") if f not in defined]
    if missing:
        fail(f"{path} defines no {' and no '.join(missing)} at its top level: {CONTRACT}")
    for name in ("build_layer", "layer_step"):
        if defined[name]:
            line, kind = defined[name]
            fail(f"{path}:{line}: {name} must be a function, not a value of type {kind}: {CONTRACT}")


def main():
    module = os.path.abspath(sys.argv[1])
    if sys.version_info < MIN_VERSION:
        fail(f"{sys.executable} is Python {sys.version.split()[0]}; the grader needs 3.9 or newer")
    check_module(module)
    path = [os.path.dirname(module)] + [p for p in sys.path if p]
    sys.path[:] = path
    if importlib.util.find_spec("torch") is None:
        fail(f"{sys.executable} has no torch: install torch for it (pip install torch), or name an interpreter "
             "that has it with --python PATH (or $PYTHON)")
    home = sys.base_prefix if sys.base_prefix == sys.base_exec_prefix else f"{sys.base_prefix}:{sys.base_exec_prefix}"
    print(json.dumps({
        "module": module,
        "executable": sys.executable,
        "version": sys.version.split()[0],
        "library": library(),
        "home": home,
        "prefix": sys.prefix,
        "exec_prefix": sys.exec_prefix,
        "path": path,
    }))


main()
