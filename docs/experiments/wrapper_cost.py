"""Session 33 (docs/benchmarks.md, thirty-third session, item 1): the host cost of a pass-through
method call, plain, through a wrapt.FunctionWrapper on the class, and through a plain function of
wrapt's wrapper signature (what patches/methods.py installs); µs a call, medians.
    python3 docs/experiments/wrapper_cost.py"""
import time, statistics, wrapt
def timeit(f, n=20000, rounds=7):
    out=[]
    for _ in range(rounds):
        t=time.perf_counter()
        for _ in range(n): f()
        out.append((time.perf_counter()-t)/n*1e6)
    return statistics.median(out)
class A(dict):
    def __call__(self, x): return x
class B(dict):
    def __call__(self, x): return x
def wrapper(wrapped, instance, args, kwargs): return args[0]
B.__call__ = wrapt.FunctionWrapper(B.__dict__["__call__"], wrapper)
class C(dict):
    def __call__(self, x): return x
orig = C.__dict__["__call__"]
def plain(self, *args, **kwargs): return wrapper(orig, self, args, kwargs)
C.__call__ = plain
class D(dict):
    def __call__(self, x): return x
origD = D.__dict__["__call__"]
def plain1(self, x): return x
D.__call__ = plain1
a,b,c,d=A(),B(),C(),D()
for n,f in [("plain method", lambda: a(1)),("wrapt FunctionWrapper", lambda: b(1)),("plain function wrapper *args", lambda: c(1)),("plain fn", lambda: d(1)), ("lambda only", lambda: 1)]:
    print(f"{n}: {timeit(f):.3f}")
