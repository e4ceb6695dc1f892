// The replay executor's loop in C++ (python/fusible/ops/replay.py): a recorded step signature's
// operator calls run as one boxed dispatcher loop, one Python call per forward and per backward
// instead of one per operator. No logic of its own: the Python recorder decides what is called
// with what (slots, constants, lists of them), which slot each output goes to and when a slot is
// dropped; this runs it. Every call goes through the dispatcher (ADInplaceOrView, autocast,
// Python modes; autograd too when grad mode is on: see exec), as a call from Python does, with the
// caller's thread-local state, so the same kernels run with the same arguments in the same order.
//
// torch.classes.fusible.ReplayProgram:
//   init(n_slots, n_inputs, unused_inputs)  the slot count; inputs are slots 0..n_inputs-1, and the
//                                            ones nothing reads are dropped before the first call
//   k_<kind>(value)                          a constant for the next add() (in argument order)
//   add(name, overload, kinds, slots, shapes, outs, frees)
//       one call: for each schema argument, kinds holds 0 (a slot, from slots), 1 (the next
//       constant), 2 (None) or 3 followed by an element count and each element's kind (0, 1 or
//       2; a list of the schema's element type); slots holds one entry per non-list argument and
//       per element (-1 where not a slot). shapes: per return, -1 (one value) or a list's length;
//       outs: the slot of each value / element (-1: unread); frees: slots dead after the call.
//   results(kinds, slots)                    what run / finish return (kinds 0 slot, 1 constant,
//                                            2 None)
//   run(inputs) -> Tensor?[]                 inputs into the slots, the calls, the results
//   start(inputs) -> token, finish(token) -> Tensor?[]
//       run in two steps: the caller drops its references to the inputs in between, so each
//       input (a backward's saved tensors) is freed after its last use. The loaded inputs wait
//       in the program under an integer token: a custom-class object as finish()'s argument
//       cost every call a failed __torch_function__ lookup on it (a C++ exception thrown and
//       caught) in the method call's override check.
#include <ATen/ScalarOps.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/grad_mode.h>
#include <ATen/core/ivalue.h>
#include <ATen/core/stack.h>
#include <c10/util/Exception.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <mutex>
#include <optional>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

namespace {

using c10::IValue;
using TensorList = c10::List<std::optional<at::Tensor>>;

struct Item {
  int64_t slot = -1;  // >= 0: that slot's value; else `value`
  IValue value;
};

struct Arg {
  bool is_list = false;
  Item item;                // !is_list
  std::vector<Item> items;  // is_list
  c10::TypePtr elem_type;   // is_list: the schema argument's element type
};

struct Call {
  c10::OperatorHandle op;
  std::vector<Arg> args;
  std::vector<int64_t> shapes;
  std::vector<int64_t> outs;
  std::vector<int64_t> frees;
};

struct ReplayProgram : torch::CustomClassHolder {
  int64_t n_slots = 0;
  int64_t n_inputs = 0;
  std::vector<int64_t> unused;
  std::vector<Call> calls;
  std::vector<Item> outputs;
  std::vector<IValue> pending;  // constants of the next add() / results()
  // start() -> finish(): the loaded inputs of backward passes under way (one each, normally).
  mutable std::mutex parked_mutex;
  mutable std::unordered_map<int64_t, std::vector<IValue>> parked;
  mutable int64_t next_token = 0;

  void init(int64_t slots, int64_t inputs, std::vector<int64_t> unused_inputs) {
    TORCH_CHECK(slots >= inputs && inputs >= 0, "ReplayProgram.init: bad slot counts");
    n_slots = slots;
    n_inputs = inputs;
    unused = std::move(unused_inputs);
  }

  void k(IValue v) { pending.push_back(std::move(v)); }

  Item item(int64_t kind, const std::vector<int64_t>& slots, size_t& si, size_t& ki) {
    Item it;
    int64_t slot = slots.at(si++);
    if (kind == 0) {
      TORCH_CHECK(slot >= 0 && slot < n_slots, "ReplayProgram: slot ", slot, " out of range");
      it.slot = slot;
    } else if (kind == 1) {
      TORCH_CHECK(ki < pending.size(), "ReplayProgram: missing constant");
      it.value = pending[ki++];
    } else {
      TORCH_CHECK(kind == 2, "ReplayProgram: bad argument kind ", kind);
    }
    return it;
  }

  void add(const std::string& name, const std::string& overload, std::vector<int64_t> kinds,
           std::vector<int64_t> slots, std::vector<int64_t> shapes, std::vector<int64_t> outs,
           std::vector<int64_t> frees) {
    Call c{c10::Dispatcher::singleton().findSchemaOrThrow(name.c_str(), overload.c_str()),
           {},
           std::move(shapes),
           std::move(outs),
           std::move(frees)};
    const auto& schema = c.op.schema();
    size_t kk = 0, si = 0, ki = 0;
    for (const auto& a : schema.arguments()) {
      TORCH_CHECK(kk < kinds.size(), "ReplayProgram.add: ", name, ": too few arguments");
      Arg arg;
      int64_t kind = kinds[kk++];
      c10::TypePtr type = a.type();
      if (auto opt = type->cast<c10::OptionalType>()) type = opt->getElementType();
      if (kind == 3) {
        auto list = type->cast<c10::ListType>();
        TORCH_CHECK(list, "ReplayProgram.add: ", name, ": argument ", a.name(), " is no list");
        arg.is_list = true;
        arg.elem_type = list->getElementType();
        int64_t n = kinds.at(kk++);
        for (int64_t j = 0; j < n; ++j) arg.items.push_back(item(kinds.at(kk++), slots, si, ki));
      } else {
        arg.item = item(kind, slots, si, ki);
        IValue& v = arg.item.value;
        if (type->kind() == c10::TypeKind::TensorType &&
            (v.isDouble() || v.isInt() || v.isBool())) {
          // A Python number given for a tensor argument (x * 2.0): the 0-dim "wrapped number"
          // tensor the call from Python makes of it (made once: kernels only read it).
          at::Tensor t = at::scalar_to_tensor(v.toScalar());
          t.unsafeGetTensorImpl()->set_wrapped_number(true);
          v = std::move(t);
        }
      }
      c.args.push_back(std::move(arg));
    }
    TORCH_CHECK(kk == kinds.size() && si == slots.size() && ki == pending.size(),
                "ReplayProgram.add: ", name, ": the argument description does not fit its schema");
    size_t n_out = 0;
    for (int64_t s : c.shapes) n_out += s < 0 ? 1 : static_cast<size_t>(s);
    TORCH_CHECK(c.shapes.size() == schema.returns().size() && n_out == c.outs.size(),
                "ReplayProgram.add: ", name, ": the outputs do not fit its schema");
    pending.clear();
    calls.push_back(std::move(c));
  }

  void results(std::vector<int64_t> kinds, std::vector<int64_t> slots) {
    size_t si = 0, ki = 0;
    outputs.clear();
    for (int64_t kind : kinds) outputs.push_back(item(kind, slots, si, ki));
    pending.clear();
  }

  std::vector<IValue> load(const TensorList& inputs) const {
    TORCH_CHECK(static_cast<int64_t>(inputs.size()) == n_inputs, "ReplayProgram: expected ",
                n_inputs, " inputs, got ", inputs.size());
    std::vector<IValue> slots(static_cast<size_t>(n_slots));
    for (size_t i = 0; i < inputs.size(); ++i) {
      std::optional<at::Tensor> t = inputs[i];
      if (t.has_value()) slots[i] = std::move(*t);
    }
    return slots;
  }

  TensorList exec(std::vector<IValue>& slots) const {
    for (int64_t s : unused) slots[s] = IValue();
    // With grad mode off (the autograd Function's forward, a backward without create_graph) the
    // autograd kernels record nothing (a custom Function's forward also runs with forward AD
    // off), but their dispatch still costs: fusible's operators have no autograd kernel, so each
    // call went through autograd's not-implemented fallback (about a fifth of a replayed step's
    // host time). Below autograd, ADInplaceOrView and every later key still run as from Python.
    std::optional<c10::impl::ExcludeDispatchKeyGuard> below_autograd;
    if (!at::GradMode::is_enabled()) below_autograd.emplace(c10::autograd_dispatch_keyset);
    torch::jit::Stack stack;
    for (const Call& c : calls) {
      stack.clear();
      stack.reserve(c.args.size());
      for (const Arg& a : c.args) {
        if (!a.is_list) {
          stack.push_back(a.item.slot >= 0 ? slots[a.item.slot] : a.item.value);
          continue;
        }
        c10::impl::GenericList list(a.elem_type);
        list.reserve(a.items.size());
        for (const Item& it : a.items) list.push_back(it.slot >= 0 ? slots[it.slot] : it.value);
        stack.emplace_back(std::move(list));
      }
      c.op.callBoxed(&stack);
      size_t k = 0;
      for (size_t r = 0; r < c.shapes.size(); ++r) {
        IValue& v = stack[r];
        if (c.shapes[r] < 0) {
          int64_t s = c.outs[k++];
          if (s >= 0) slots[s] = std::move(v);
          continue;
        }
        auto list = v.toList();
        for (int64_t j = 0; j < c.shapes[r]; ++j) {
          int64_t s = c.outs[k++];
          if (s >= 0) slots[s] = list.get(static_cast<size_t>(j));
        }
      }
      stack.clear();
      for (int64_t s : c.frees) slots[s] = IValue();
    }
    TensorList out;
    out.reserve(outputs.size());
    for (const Item& it : outputs) {
      const IValue& v = it.slot >= 0 ? slots[it.slot] : it.value;
      out.push_back(v.isNone() ? std::optional<at::Tensor>() : std::optional(v.toTensor()));
    }
    return out;
  }

  TensorList run(const TensorList& inputs) const {
    std::vector<IValue> slots = load(inputs);
    return exec(slots);
  }

  int64_t start(const TensorList& inputs) const {
    std::vector<IValue> slots = load(inputs);
    const std::lock_guard<std::mutex> lock(parked_mutex);
    const int64_t token = next_token++;
    parked.emplace(token, std::move(slots));
    return token;
  }

  TensorList finish(int64_t token) const {
    std::vector<IValue> slots;
    {
      const std::lock_guard<std::mutex> lock(parked_mutex);
      auto it = parked.find(token);
      TORCH_CHECK(it != parked.end(), "ReplayProgram.finish: no inputs under token ", token);
      slots = std::move(it->second);
      parked.erase(it);
    }
    return exec(slots);
  }

  int64_t size() const { return static_cast<int64_t>(calls.size()); }
};

}  // namespace

TORCH_LIBRARY_FRAGMENT(fusible, m) {
  m.class_<ReplayProgram>("ReplayProgram")
      .def(torch::init<>())
      .def("init", &ReplayProgram::init)
      .def("k_tensor", [](const c10::intrusive_ptr<ReplayProgram>& p, at::Tensor v) { p->k(v); })
      .def("k_int", [](const c10::intrusive_ptr<ReplayProgram>& p, int64_t v) { p->k(v); })
      .def("k_float", [](const c10::intrusive_ptr<ReplayProgram>& p, double v) { p->k(v); })
      .def("k_bool", [](const c10::intrusive_ptr<ReplayProgram>& p, bool v) { p->k(v); })
      .def("k_str", [](const c10::intrusive_ptr<ReplayProgram>& p, std::string v) { p->k(v); })
      .def("k_dtype", [](const c10::intrusive_ptr<ReplayProgram>& p, at::ScalarType v) { p->k(v); })
      .def("k_device", [](const c10::intrusive_ptr<ReplayProgram>& p, c10::Device v) { p->k(v); })
      .def("k_layout", [](const c10::intrusive_ptr<ReplayProgram>& p, at::Layout v) { p->k(v); })
      .def("k_memory_format",
           [](const c10::intrusive_ptr<ReplayProgram>& p, at::MemoryFormat v) { p->k(v); })
      .def("k_ints", [](const c10::intrusive_ptr<ReplayProgram>& p,
                        std::vector<int64_t> v) { p->k(c10::List<int64_t>(v)); })
      .def("k_floats", [](const c10::intrusive_ptr<ReplayProgram>& p,
                          std::vector<double> v) { p->k(c10::List<double>(v)); })
      .def("k_bools", [](const c10::intrusive_ptr<ReplayProgram>& p,
                         c10::List<bool> v) { p->k(std::move(v)); })
      .def("add", &ReplayProgram::add)
      .def("results", &ReplayProgram::results)
      .def("run", &ReplayProgram::run)
      .def("start", &ReplayProgram::start)
      .def("finish", &ReplayProgram::finish)
      .def("size", &ReplayProgram::size);
}
