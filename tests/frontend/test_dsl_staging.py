"""Staging tests for the DSL: golden IR text, one check per operator/method, cond, calls,
signatures, the cache and error messages. No VM needed."""
from __future__ import annotations

import numpy as np
import pytest

import remat
from remat.frontend.dsl import Staged, Tensor, TracingError, ops
from remat.ir import parse, verify


def stage(fn, *types):
    """Stage ``fn`` for ``types`` and check the module verifies and round-trips through the text."""
    s = remat.function(fn).specialize(*types)
    verify(s.module)
    assert str(parse(s.ir)) == s.ir
    return s


def ops_of(s: Staged) -> list[str]:
    return [ins.op.name for ins in s.module[s.name].instructions()]


F23, F3, F34 = remat.f32[2, 3], remat.f32[3], remat.f32[3, 4]


# ---------------------------------------------------------------- golden text
def test_mlp_golden():
    @remat.function
    def mlp(x: remat.f32[4, 8], w: remat.f32[8, 3], b: remat.f32[1, 3]):
        return ops.softmax((x @ w + b).relu(), axis=1)

    assert mlp.ir == """\
func @mlp(%0: f32[4,8], %1: f32[8,3], %2: f32[1,3]) -> f32[4,3] {
  %3 = matmul %0, %1 : f32[4,3]
  %4 = add %3, %2 : f32[4,3]
  %5 = relu %4 : f32[4,3]
  %6 = softmax %5 {axis=1} : f32[4,3]
  return %6
}
"""
    assert mlp.name == "mlp"
    assert mlp.__remat_function__() is mlp.module["mlp"]


def test_scalar_constants_take_the_tensor_dtype():
    @remat.function
    def f(x: remat.f64[2], n: remat.i32[2]):
        return 1 - x * 2, n + 3

    assert f.ir == """\
func @f(%0: f64[2], %1: i32[2]) -> (f64[2], i32[2]) {
  %2 = constant {value=2.0, dtype=f64} : f64[]
  %3 = mul %0, %2 : f64[2]
  %4 = constant {value=1.0, dtype=f64} : f64[]
  %5 = sub %4, %3 : f64[2]
  %6 = constant {value=3, dtype=i32} : i32[]
  %7 = add %1, %6 : i32[2]
  return %5, %7
}
"""


def test_cond_golden():
    @remat.function
    def f(x: remat.f32[3]):
        return remat.cond(x.sum() > 0, lambda v: v * 2.0, lambda v: -v, x)

    assert f.ir == """\
func @f(%0: f32[3]) -> f32[3] {
  %1 = reduce_sum %0 {axes=[0]} : f32[]
  %2 = constant {value=0.0} : f32[]
  %3 = gt %1, %2 : bool[]
  cond_br %3, ^bb1, ^bb2
^bb1:
  %4 = constant {value=2.0} : f32[]
  %5 = mul %0, %4 : f32[3]
  br ^bb3(%5)
^bb2:
  %6 = neg %0 : f32[3]
  br ^bb3(%6)
^bb3(%7: f32[3]):
  return %7
}
"""


def test_call_golden_and_callee_added_once():
    @remat.function
    def layer(x, w):
        return (x @ w).tanh()

    @remat.function
    def net(x: remat.f32[2, 4], w1: remat.f32[4, 4], w2: remat.f32[4, 4]):
        return layer(layer(x, w1), w2)

    assert net.ir == """\
func @net(%0: f32[2,4], %1: f32[4,4], %2: f32[4,4]) -> f32[2,4] {
  %3 = call @layer(%0, %1) : f32[2,4]
  %4 = call @layer(%3, %2) : f32[2,4]
  return %4
}

func @layer(%0: f32[2,4], %1: f32[4,4]) -> f32[2,4] {
  %2 = matmul %0, %1 : f32[2,4]
  %3 = tanh %2 : f32[2,4]
  return %3
}
"""
    assert layer.trace_count == 1


def test_call_two_specializations_get_unique_names():
    @remat.function
    def sq(x):
        return x * x

    @remat.function
    def f(a: remat.f32[2], b: remat.f32[3]):
        return sq(a), sq(b), sq(sq(a))

    m = f.module
    assert list(m.functions) == ["f", "sq", "sq_1"]
    calls = [i.attrs["callee"] for i in m["f"].instructions() if i.op.name == "call"]
    assert calls == ["sq", "sq_1", "sq", "sq"]
    assert m["sq_1"].param_types == [remat.f32[3]]
    assert sq.trace_count == 2


def test_nested_calls_collect_transitively():
    @remat.function
    def inner(x):
        return x.exp()

    @remat.function
    def middle(x):
        return inner(x) + 1.0

    @remat.function
    def outer(x: remat.f32[2]):
        return middle(x) * inner(x)

    assert list(outer.module.functions) == ["outer", "middle", "inner"]
    assert str(parse(outer.ir)) == outer.ir


# ---------------------------------------------------------------- one check per operator / method
BINARY = [
    (lambda x, y: x + y, "add"), (lambda x, y: x - y, "sub"), (lambda x, y: x * y, "mul"),
    (lambda x, y: x / y, "div"), (lambda x, y: x ** y, "pow"),
    (lambda x, y: x < y, "lt"), (lambda x, y: x <= y, "le"), (lambda x, y: x > y, "gt"),
    (lambda x, y: x >= y, "ge"), (lambda x, y: x == y, "eq"), (lambda x, y: x != y, "ne"),
    (ops.maximum, "maximum"), (ops.minimum, "minimum"),
]


@pytest.mark.parametrize("fn,op", BINARY, ids=[b[1] for b in BINARY])
def test_binary_operators(fn, op):
    s = stage(fn, F23, F3)
    assert ops_of(s) == [op, "return"]
    out = s.module[s.name].result_types[0]
    assert out.shape == (2, 3)
    assert out.dtype == (remat.DType.bool if op in ("lt", "le", "gt", "ge", "eq", "ne") else remat.DType.f32)


@pytest.mark.parametrize("fn,op", [(lambda x: x + 1, "add"), (lambda x: 1 + x, "add"), (lambda x: 2 * x, "mul"),
                                   (lambda x: 1 / x, "div"), (lambda x: 2 ** x, "pow"), (lambda x: 3 - x, "sub"),
                                   (lambda x: 0 < x, "gt")])
def test_reflected_scalar_operators(fn, op):
    s = stage(fn, F3)
    assert ops_of(s) == ["constant", op, "return"]


LOGIC = [(lambda a, b: a & b, "and"), (lambda a, b: a | b, "or"), (lambda a, b: a ^ b, "ne"),
         (lambda a, b: ~a, "not"), (ops.logical_and, "and"), (ops.logical_or, "or"),
         (lambda a, b: ops.logical_not(b), "not")]


@pytest.mark.parametrize("fn,op", LOGIC, ids=[f"{i}-{x[1]}" for i, x in enumerate(LOGIC)])
def test_logic_operators(fn, op):
    s = stage(fn, remat.bool_[2, 3], remat.bool_[3])
    assert ops_of(s) == [op, "return"]


UNARY = [(lambda x: -x, "neg"), (abs, "abs"), (lambda x: x.exp(), "exp"), (lambda x: x.log(), "log"),
         (lambda x: x.sqrt(), "sqrt"), (lambda x: x.tanh(), "tanh"), (lambda x: x.relu(), "relu"),
         (lambda x: x.sigmoid(), "sigmoid"), (lambda x: x.rsqrt(), "rsqrt"), (lambda x: x.sin(), "sin"),
         (lambda x: x.cos(), "cos"), (lambda x: ops.gelu(x), "gelu"), (ops.erf, "erf"), (ops.sign, "sign"), (ops.copy, "copy"),
         (lambda x: x.softmax(0), "softmax"), (lambda x: ops.log_softmax(x, -1), "log_softmax")]


@pytest.mark.parametrize("fn,op", UNARY, ids=[u[1] for u in UNARY])
def test_unary(fn, op):
    s = stage(fn, F23)
    assert ops_of(s) == [op, "return"]


def test_reductions():
    s = stage(lambda x: (x.sum(), x.sum(axis=1), x.mean(axis=(0, -1), keepdims=True), x.max(0), x.min(axis=-1)),
              remat.f32[2, 3, 4])
    f = s.module[s.name]
    assert [str(t) for t in f.result_types] == ["f32[]", "f32[2,4]", "f32[1,3,1]", "f32[3,4]", "f32[2,3]"]
    reds = [(i.op.name, i.attrs["axes"], i.attrs["keepdims"]) for i in f.instructions() if i.op.has("reduction")]
    assert reds == [("reduce_sum", (0, 1, 2), False), ("reduce_sum", (1,), False), ("reduce_mean", (0, 2), True),
                    ("reduce_max", (0,), False), ("reduce_max", (2,), False)]
    assert ops_of(s).count("neg") == 2  # min = -max(-x)


def test_shape_methods():
    s = stage(lambda x: (x.reshape(4, -1), x.reshape((6, 4)), x.transpose(2, 0, 1), x.transpose(), x.T,
                         x.astype(remat.f64), x.astype("f32")), remat.f32[2, 3, 4])
    f = s.module[s.name]
    assert [str(t) for t in f.result_types] == ["f32[4,6]", "f32[6,4]", "f32[4,2,3]", "f32[4,3,2]", "f32[2,4,3]",
                                                "f64[2,3,4]", "f32[2,3,4]"]
    assert ops_of(s) == ["reshape", "reshape", "transpose", "transpose", "transpose", "cast", "return"]


def test_static_properties():
    seen = {}

    def f(x):
        seen.update(shape=x.shape, dtype=x.dtype, ndim=x.ndim, size=x.size, len=len(x))
        return x

    stage(f, remat.i32[5, 2])
    assert seen == dict(shape=(5, 2), dtype=remat.DType.i32, ndim=2, size=10, len=5)


def test_identity_shapes_emit_nothing():
    s = stage(lambda x: (x.reshape(2, 3), x.transpose(0, 1), x.astype(remat.f32), x[:], x[...], x.sum(axis=())), F23)
    assert ops_of(s) == ["return"]


def test_matmul_vectors_follow_numpy():
    s = stage(lambda m, v: (m @ v, v @ m.T, ops.matmul(v, m.T)), remat.f32[2, 3], remat.f32[3])
    f = s.module[s.name]
    assert [str(t) for t in f.result_types] == ["f32[2]", "f32[2]", "f32[2]"]


# ---------------------------------------------------------------- indexing
def index_types(key, t=remat.f32[4, 5, 6]):
    s = stage(lambda x: x[key], t)
    f = s.module[s.name]
    return f.result_types[0].shape, ops_of(s)[:-1]


@pytest.mark.parametrize("key", [
    (1,), (-1,), (slice(1, 3),), (slice(None), 2), (Ellipsis, 0), (Ellipsis, -2), (slice(None, None, 2),),
    (slice(None, None, -1),), (slice(3, 0, -2), Ellipsis, 1), (None, 1), (1, None, slice(2, 4), Ellipsis),
    (slice(10, 20),), (slice(1, 4), slice(None), slice(5, None, -3)), ([2, 0, -1],), (slice(None), [1]),
])
def test_indexing_shapes_match_numpy(key):
    ref = np.zeros((4, 5, 6))[key]
    shape, ops_ = index_types(key)
    assert shape == ref.shape
    assert set(ops_) <= {"slice", "reshape", "gather", "iota", "constant", "sub", "concat"}


def test_indexing_ops():
    assert index_types((1,))[1] == ["slice", "reshape"]
    assert index_types((slice(1, 3),))[1] == ["slice"]
    assert index_types((slice(None, None, -1),))[1] == ["constant", "iota", "sub", "gather"]


def test_tensor_index_is_gather():
    s = stage(lambda table, idx: (table[idx], table[:, idx], ops.gather(table, idx, axis=1)),
              remat.f32[10, 3], remat.i64[2, 4])
    f = s.module[s.name]
    assert [str(t) for t in f.result_types] == ["f32[2,4,3]", "f32[10,2,4]", "f32[10,2,4]"]
    assert [(i.op.name, i.attrs.get("axis")) for i in f.instructions()][:3] == [("gather", 0), ("gather", 1), ("gather", 1)]


@pytest.mark.parametrize("key,msg", [
    ((0, 0, 0, 0), "too many indices"), ((4,), "out of bounds for axis 0"), ((Ellipsis, Ellipsis), "single ellipsis"),
    ((slice(None), -7), "out of bounds for axis 1"), ((1.5,), "unsupported index"), (([],), "empty list"),
])
def test_indexing_errors(key, msg):
    with pytest.raises(IndexError, match=msg):
        stage(lambda x: x[key], remat.f32[4, 5, 6])


def test_mask_index_error():
    with pytest.raises(IndexError, match="where"):
        stage(lambda x, m: x[m], remat.f32[4], remat.bool_[4])


def test_setitem_is_rejected():
    def f(x):
        x[0] = 1.0
        return x

    with pytest.raises(TypeError, match="immutable"):
        stage(f, F3)


# ---------------------------------------------------------------- ops namespace
def test_nn_ops():
    def f(x, w, b):
        y = ops.conv2d(x, w, b, stride=1, padding=1)
        return ops.max_pool2d(y, 2), ops.avg_pool2d(y, 3, stride=1, padding=1), ops.gelu(y, approximate="tanh")

    s = stage(f, remat.f32[2, 3, 8, 8], remat.f32[4, 3, 3, 3], remat.f32[4])
    fn = s.module[s.name]
    assert [str(t) for t in fn.result_types] == ["f32[2,4,4,4]", "f32[2,4,8,8]", "f32[2,4,8,8]"]
    conv = next(i for i in fn.instructions() if i.op.name == "conv2d")
    assert conv.attrs["padding"] == (1, 1) and conv.attrs["stride"] == (1, 1)


def test_shape_ops():
    def f(x, idx, upd):
        return (ops.concat([x, x * 2], axis=-1), ops.pad(x, [1, 0], [0, 2], value=1.0), ops.broadcast_to(x, (4, 2, 3)),
                ops.slice(x, [0, 1], [2, 3], [1, 2]), ops.transpose(x), ops.reshape(x, [-1]),
                ops.scatter_add(idx, upd, (5, 3)), ops.where(x > 0, x, 0.0), ops.cast(x, remat.f16))

    s = stage(f, F23, remat.i64[2], remat.f32[2, 3])
    fn = s.module[s.name]
    assert [str(t) for t in fn.result_types] == ["f32[2,6]", "f32[3,5]", "f32[4,2,3]", "f32[2,1]", "f32[3,2]",
                                                 "f32[6]", "f32[5,3]", "f32[2,3]", "f16[2,3]"]


def test_value_ops():
    def f(seed):
        k = ops.fold_seed(seed, 3)
        return (ops.zeros((2,)), ops.ones((2, 2), remat.i32), ops.full((3,), True), ops.constant(2.5, (1,), remat.f64),
                ops.iota((2, 3), axis=-1), ops.uniform(k, (2, 2), low=-1.0), ops.normal(7, (3,), std=0.5),
                ops.bernoulli(seed, (4,), 0.25), ops.one_hot(ops.iota((3,)), 4))

    s = stage(f, remat.i64[()])
    fn = s.module[s.name]
    assert [str(t) for t in fn.result_types] == ["f32[2]", "i32[2,2]", "bool[3]", "f64[1]", "i64[2,3]", "f32[2,2]",
                                                 "f32[3]", "bool[4]", "f32[3,4]"]
    rnd = [i for i in fn.instructions() if i.op.has("random")]
    assert [i.op.name for i in rnd] == ["uniform", "normal", "bernoulli"]


def test_dropout_replays_its_seed():
    s = stage(lambda x, seed: ops.dropout(x, 0.5, seed), F23, remat.i64[()])
    assert ops_of(s) == ["bernoulli", "constant", "mul", "constant", "select", "return"]


def test_emit_any_op():
    s = stage(lambda x: ops.emit("reduce_sum", x, axes=[1], keepdims=True), F23)
    assert str(s.module[s.name].result_types[0]) == "f32[2,1]"


# ---------------------------------------------------------------- cond
def test_cond_multiple_results_and_scalars():
    def f(x, p):
        return remat.cond(p, lambda a: (a, 1.0), lambda a: (a * 3, a), x)

    s = stage(f, F3, remat.bool_[()])
    fn = s.module[s.name]
    assert [str(t) for t in fn.result_types] == ["f32[3]", "f32[3]"]
    assert len(fn.blocks) == 4
    assert [str(t.type) for t in fn.blocks[3].args] == ["f32[3]", "f32[3]"]


def test_nested_cond_keeps_block_order():
    def f(x):
        def outer_true(v):
            return remat.cond(v.max() > 1, lambda u: u * 2, lambda u: u + 2, v)

        return remat.cond(x.sum() > 0, outer_true, lambda v: v, x)

    s = stage(f, F3)
    fn = s.module[s.name]
    # entry, outer true, inner true, inner false, inner join, outer false, outer join: in nesting order
    assert len(fn.blocks) == 7
    assert [b.instrs[-1].op.name for b in fn.blocks] == ["cond_br", "cond_br", "br", "br", "br", "br", "return"]


def test_cond_closes_over_outer_values():
    s = stage(lambda x, y: remat.cond(x.sum() > 0, lambda: x + y, lambda: y), F3, F3)
    assert len(s.module[s.name].blocks) == 4


def test_cond_type_mismatch():
    with pytest.raises(TypeError, match="different types for result 0: true branch f32\\[3\\], false branch f32\\[\\]"):
        stage(lambda x: remat.cond(x.sum() > 0, lambda v: v, lambda v: v.sum(), x), F3)
    with pytest.raises(TypeError, match="different structures"):
        stage(lambda x: remat.cond(x.sum() > 0, lambda v: (v, v), lambda v: v, x), F3)


def test_cond_needs_bool_scalar():
    with pytest.raises(TypeError, match="bool\\[\\] predicate.*got bool\\[3\\]"):
        stage(lambda x: remat.cond(x > 0, lambda: x, lambda: x), F3)
    with pytest.raises(TypeError, match="bool\\[\\] predicate"):
        stage(lambda x: remat.cond(True, lambda: x, lambda: x), F3)


def test_branch_value_leaking_out_of_cond():
    leaked = []

    def f(x):
        def t(v):
            leaked.append(v * 2)
            return v

        y = remat.cond(x.sum() > 0, t, lambda v: v, x)
        return y + leaked[0]

    with pytest.raises(TracingError, match="inside a remat.cond branch.*return it from both branch"):
        stage(f, F3)


# ---------------------------------------------------------------- signatures and the cache
def test_unannotated_parameters_specialize_per_signature():
    @remat.function
    def f(x, y: remat.f32[3]):
        return x + y

    with pytest.raises(TypeError, match="unannotated parameters \\('x'\\)"):
        f.ir
    a = f.specialize(remat.f32[3], remat.f32[3])
    b = f.specialize(np.zeros((2, 3), np.float32), remat.f32[3])
    a2 = f.specialize(remat.f32[3], remat.f32[3])
    assert f.trace_count == 2
    assert a.module is a2.module
    assert str(b.module["f"].result_types[0]) == "f32[2,3]"
    assert f.signatures == [(remat.f32[3], remat.f32[3]), (remat.f32[2, 3], remat.f32[3])]
    assert "f32[2,3]" not in f.ir  # the last specialization used is a2
    f.specialize(remat.f32[2, 3], remat.f32[3])
    assert "f32[2,3]" in f.ir and f.trace_count == 2


def test_annotation_strings_are_evaluated():
    ns: dict = {}
    exec("from __future__ import annotations\nimport remat\n"
         "def f(x: remat.f32[2]):\n    return x * x\n", ns)
    s = remat.function(ns["f"])
    assert s.param_names == ("x",) and "f32[2]" in s.ir


def test_bad_annotation():
    def f(x: int):
        return x

    with pytest.raises(TypeError, match="parameter 'x' has annotation .*remat.f32\\[1, 784\\]"):
        remat.function(f)


def test_varargs_rejected():
    def f(*xs):
        return xs[0]

    with pytest.raises(TypeError, match=r"\*xs"):
        remat.function(f)


def test_staged_call_type_errors_name_the_parameter():
    @remat.function
    def g(a: remat.f32[2], b: remat.f32[2]):
        return a * b

    with pytest.raises(TypeError, match="@g: parameter 'b' expects f32\\[2\\], got f32\\[3\\]"):
        stage(lambda x, y: g(x, y), remat.f32[2], remat.f32[3])
    with pytest.raises(TypeError, match="@g takes 2 argument"):
        stage(lambda x: g(x), remat.f32[2])


def test_staged_call_with_scalar_argument():
    @remat.function
    def scale(x, k: remat.f32[()]):
        return x * k

    s = stage(lambda x: scale(x, 3), F3)
    assert ops_of(s) == ["constant", "call", "return"]


def test_recursion_is_rejected():
    @remat.function
    def r(x):
        return r(x)

    with pytest.raises(TracingError, match="recursion"):
        r.specialize(F3)


def test_from_module_wraps_existing_ir():
    text = """\
func @f(%0: f32[2]) -> f32[2] {
  %1 = call @g(%0) : f32[2]
  return %1
}

func @g(%0: f32[2]) -> f32[2] {
  %1 = exp %0 : f32[2]
  return %1
}
"""
    s = Staged.from_module(parse(text), "f")
    assert s.ir == text and s.name == "f" and s.param_names == ("%0",)

    @remat.function
    def h(x: remat.f32[2]):
        return s(x) + s(x)

    assert list(h.module.functions) == ["h", "f", "g"]
    verify(h.module)


def test_derive_applies_a_transform_per_signature():
    @remat.function
    def f(x):
        return x * 2

    def renamed(module, name):
        m = module.clone()
        g = m[name].clone(name + "_copy")
        return remat.Module([g]), g.name

    d = f.derive(renamed)
    spec = d.specialize(F3)
    assert spec.name == "f_copy" and "f32[3]" in spec.ir
    assert d.specialize(F23).module["f_copy"].param_types == [F23]


# ---------------------------------------------------------------- tracing errors
def test_python_if_on_proxy():
    def f(x):
        if x.sum() > 0:
            return x
        return -x

    with pytest.raises(TracingError, match="truth value.*remat.cond\\(pred, true_fn, false_fn, \\*operands\\)"):
        stage(f, F3)


@pytest.mark.parametrize("fn,msg", [
    (lambda x: float(x.sum()), "Python float value"),
    (lambda x: x[int(x.sum())], "Python int value"),
    (lambda x: x + np.ones(3, np.float32), "pass the array as a parameter"),
    (lambda x: np.ones(3, np.float32) + x, "pass the array as a parameter"),
    (lambda x: np.asarray(x), "cannot become a NumPy array"),
])
def test_tracing_errors(fn, msg):
    with pytest.raises(TracingError, match=msg):
        stage(fn, F3)


def test_mixed_dtypes_raise():
    with pytest.raises(TypeError, match="'\\+' mixes f32\\[3\\] and f64\\[3\\].*astype"):
        stage(lambda x, y: x + y, F3, remat.f64[3])
    with pytest.raises(TypeError, match="Python float 0.5 with a i64 tensor"):
        stage(lambda n: n * 0.5, remat.i64[3])
    with pytest.raises(TypeError, match="true division"):
        stage(lambda n: n / 2, remat.i64[3])
    with pytest.raises(TypeError, match="'&' takes bool tensors"):
        stage(lambda n: n & n, remat.i64[3])
    with pytest.raises(TypeError, match="contraction mismatch"):
        stage(lambda a, b: a @ b, F23, F23)


def test_leaked_proxy_after_staging():
    keep = []

    @remat.function
    def f(x: remat.f32[3]):
        keep.append(x)
        return x

    f.module

    @remat.function
    def g(y: remat.f32[3]):
        return y + keep[0]

    with pytest.raises(TracingError, match="used after its staging finished"):
        g.module


def test_captured_proxy_of_outer_function():
    @remat.function
    def outer(x: remat.f32[3]):
        @remat.function
        def inner(y):
            return y + x

        return inner(x)

    with pytest.raises(TracingError, match="captured inside @inner; pass it to @inner as an argument"):
        outer.module


def test_ops_outside_staging():
    with pytest.raises(TracingError, match="inside a function decorated with @remat.function"):
        ops.zeros((2,))


def test_return_none_is_an_error():
    with pytest.raises(TypeError, match="returned None"):
        stage(lambda x: None, F3)


def test_proxy_hashes_by_identity():
    def f(x):
        d = {x: 1}
        assert x in d and isinstance(x == x, Tensor)
        return x

    stage(f, F3)


def test_public_names():
    assert remat.function is not None and remat.cond is ops.cond and remat.ops is ops
    assert remat.Staged is Staged


def test_keyword_arguments_and_keyword_only_parameters():
    @remat.function
    def f(x, *, scale: remat.f32[()]):
        return x * scale

    s = f.specialize(F3, scale=remat.f32[()])
    assert s.module["f"].param_types == [F3, remat.f32[()]]
    assert f.param_names == ("x", "scale")
    with pytest.raises(TypeError, match="@f takes 2 argument\\(s\\) \\(x, scale\\)"):
        f.specialize(F3, remat.f32[()])


def test_unresolvable_annotation():
    ns: dict = {}
    exec("from __future__ import annotations\ndef f(x: Missing[2]):\n    return x\n", ns)
    with pytest.raises(TypeError, match="annotation cannot be evaluated"):
        remat.function(ns["f"])


def test_ops_namespace_is_complete():
    for name in ops.__all__:
        assert callable(getattr(ops, name)), name
