// RingreduceAsyncCall: a TensorFlow op that hands its inputs to Python and
// returns without holding the thread; Python calls back when the result is
// there (Horovod's AsyncOpKernel pattern, as a generic call).
//
// Why: in a TF1 graph run by a Session, a collective that blocks (a
// numpy_function waiting for its partner) holds one of TensorFlow's inter-op
// threads. With more independent collectives than threads, ranks that start
// them in different orders each block on names the other has not started:
// deadlock. This kernel blocks nothing: ComputeAsync copies nothing itself,
// calls the registered Python start function (which copies the inputs and
// queues the work) and returns; ringreduce_tf_complete, called later from any
// thread, allocates the outputs, copies the results in, sets the status and
// calls done().
//
// Knows nothing of collectives: `token` names the Python function to run
// (ringreduce/tensorflow/async_op.py). Built at first use by that module,
// against the installed TensorFlow's headers (tf.sysconfig).
#include <atomic>
#include <cstring>
#include <mutex>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "tensorflow/core/framework/cancellation.h"
#include "tensorflow/core/framework/common_shape_fns.h"
#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/shape_inference.h"

using namespace tensorflow;

extern "C" {
// Called on TensorFlow's thread, inside ComputeAsync. data[i] is valid only
// during the call: the callee copies what it keeps. It must end every call
// with exactly one ringreduce_tf_complete(call, ...), now or later.
typedef void (*ringreduce_tf_start_fn)(const char* token, void* call, int n, const int* dtypes, const int* ndims,
                                       const int64_t* dims, const void* const* data);
}

namespace {

std::atomic<ringreduce_tf_start_fn> start_fn{nullptr};

// One op in flight. Ended once, by whichever comes first: Python's
// ringreduce_tf_complete, or the step's cancellation (Session.close, a
// RunOptions timeout), which fails the op at once so session.run returns;
// Python's later completion then only drops its reference. Freed by the last
// of its holders (Python, ComputeAsync, the cancellation callback).
struct PendingCall {
  OpKernelContext* ctx;
  AsyncOpKernel::DoneCallback done;
  std::mutex mu;
  bool finished = false;  // under mu: done() is called, or is being called
  CancellationManager* cm = nullptr;  // with token, where the callback is registered
  CancellationToken token = CancellationManager::kInvalidToken;
  std::atomic<int> refs{3};

  void Unref() {
    if (refs.fetch_sub(1) == 1) delete this;
  }
  // Claims the right to call done(); false where it is taken already.
  bool Claim() {
    std::lock_guard<std::mutex> lock(mu);
    if (finished) return false;
    finished = true;
    return true;
  }
  void Cancel() {
    if (!Claim()) return;
    ctx->SetStatus(absl::CancelledError("ringreduce: the step was cancelled (Session.close or a timeout) while "
                                        "this collective waited for its partners"));
    AsyncOpKernel::DoneCallback d = std::move(done);
    d();
  }
};

class RingreduceAsyncCallOp : public AsyncOpKernel {
 public:
  explicit RingreduceAsyncCallOp(OpKernelConstruction* ctx) : AsyncOpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("token", &token_));
  }

  void ComputeAsync(OpKernelContext* ctx, DoneCallback done) override {
    ringreduce_tf_start_fn start = start_fn.load();
    OP_REQUIRES_ASYNC(ctx, start != nullptr,
                      absl::FailedPreconditionError("ringreduce's Python side is not loaded in this process "
                                                    "(import ringreduce.tensorflow)"),
                      done);
    const int n = ctx->num_inputs();
    std::vector<int> dtypes(n), ndims(n);
    std::vector<int64_t> dims;
    std::vector<const void*> data(n);
    for (int i = 0; i < n; ++i) {
      const Tensor& t = ctx->input(i);
      OP_REQUIRES_ASYNC(ctx, DataTypeCanUseMemcpy(t.dtype()),
                        absl::InvalidArgumentError(absl::StrCat("ringreduce collectives take fixed-size dtypes, not ",
                                                                DataTypeString(t.dtype()))),
                        done);
      dtypes[i] = static_cast<int>(t.dtype());
      ndims[i] = t.dims();
      for (int d = 0; d < t.dims(); ++d) dims.push_back(t.dim_size(d));
      data[i] = t.tensor_data().data();
    }
    auto* call = new PendingCall();
    call->ctx = ctx;
    call->done = std::move(done);
    CancellationManager* cm = ctx->cancellation_manager();  // read now: ctx may be gone once start returns
    start(token_.c_str(), call, n, dtypes.data(), ndims.data(), dims.data(), data.data());
    // Registered after start, as the inputs must stay valid while Python
    // copies them; not where Python has completed the call already.
    bool cancelled = false, registered = false;
    {
      std::lock_guard<std::mutex> lock(call->mu);
      if (!call->finished && cm != nullptr) {
        const CancellationToken token = cm->get_cancellation_token();
        registered = cm->RegisterCallback(token, [call] {
          call->Cancel();
          call->Unref();
        });
        if (registered) call->cm = cm, call->token = token;
        else cancelled = true;
      }
    }
    if (!registered) call->Unref();  // the callback's reference, never used
    if (cancelled) call->Cancel();
    call->Unref();  // ComputeAsync's
  }

 private:
  std::string token_;
};

// A TensorFlow error code as absl knows it (1..16); anything else is INTERNAL.
absl::StatusCode known_code(int code) {
  return code >= 1 && code <= 16 ? static_cast<absl::StatusCode>(code) : absl::StatusCode::kInternal;
}

}  // namespace

extern "C" {

void ringreduce_tf_set_start(ringreduce_tf_start_fn fn) { start_fn.store(fn); }

// Ends a call: code 0 with n results (dtype, shape, bytes each), or a
// TensorFlow error code and its message. Any thread; data is copied before
// it returns. Returns 0, or -1 where the results did not fit the op's outputs
// (the op then fails with that, and done() is called all the same).
int ringreduce_tf_complete(void* handle, int code, const char* message, int n, const int* dtypes, const int* ndims,
                           const int64_t* dims, const void* const* data) {
  auto* call = static_cast<PendingCall*>(handle);
  if (!call->Claim()) {  // cancelled already: session.run has returned
    call->Unref();
    return 0;
  }
  if (call->cm != nullptr && call->cm->DeregisterCallback(call->token)) call->Unref();  // it will never run
  OpKernelContext* ctx = call->ctx;
  absl::Status status;
  if (code != 0) {
    status = absl::Status(known_code(code), message ? message : "");
  } else if (n != ctx->num_outputs()) {
    status = absl::InternalError(absl::StrCat("ringreduce returned ", n, " results for ", ctx->num_outputs(), " outputs"));
  } else {
    const int64_t* dim = dims;
    for (int i = 0; i < n && status.ok(); ++i) {
      if (dtypes[i] != static_cast<int>(ctx->expected_output_dtype(i))) {
        status = absl::InternalError(absl::StrCat("ringreduce returned ", DataTypeString(static_cast<DataType>(dtypes[i])),
                                                  " for output ", i, " of type ",
                                                  DataTypeString(ctx->expected_output_dtype(i))));
        break;
      }
      TensorShape shape;
      status = TensorShape::BuildTensorShape(absl::Span<const int64_t>(dim, ndims[i]), &shape);
      dim += ndims[i];
      Tensor* out = nullptr;
      if (status.ok()) status = ctx->allocate_output(i, shape, &out);
      if (status.ok() && out->TotalBytes() > 0) std::memcpy(const_cast<char*>(out->tensor_data().data()), data[i], out->TotalBytes());
    }
  }
  int rc = (code == 0 && !status.ok()) ? -1 : 0;
  if (!status.ok()) ctx->SetStatus(status);
  AsyncOpKernel::DoneCallback done = std::move(call->done);
  call->Unref();  // Python's
  done();
  return rc;
}

}  // extern "C"

REGISTER_OP("RingreduceAsyncCall")
    .Input("inputs: Tin")
    .Output("outputs: Tout")
    .Attr("Tin: list(type) >= 0")
    .Attr("Tout: list(type) >= 0")
    .Attr("token: string")
    .SetIsStateful()  // never folded, merged with a twin, or cached: every run is a collective
    .SetShapeFn(shape_inference::UnknownShape)
    .Doc("Runs the Python function registered as `token` (ringreduce) without holding the thread.");

REGISTER_KERNEL_BUILDER(Name("RingreduceAsyncCall").Device(DEVICE_CPU), RingreduceAsyncCallOp);

// RingreduceStatus: passes `values` through, or fails with the status a
// Python function reported as (code, message). Inside a tf.function the
// collectives run as numpy_functions (cheaper there than the asynchronous
// op), and TensorFlow reports every Python exception of one as UnknownError;
// they return their error as (code, message) instead, and this op makes it
// the error of that code (a mismatch: FAILED_PRECONDITION; a refused
// argument: INVALID_ARGUMENT). Stateful, so it runs even where nobody reads
// the values: a failed collective is never silently dropped.
class RingreduceStatusOp : public OpKernel {
 public:
  explicit RingreduceStatusOp(OpKernelConstruction* ctx) : OpKernel(ctx) {}

  void Compute(OpKernelContext* ctx) override {
    const Tensor& code = ctx->input(0);
    const Tensor& message = ctx->input(1);
    OP_REQUIRES(ctx, TensorShapeUtils::IsScalar(code.shape()) && TensorShapeUtils::IsScalar(message.shape()),
                absl::InternalError("RingreduceStatus: code and message must be scalars"));
    const int c = code.scalar<int32>()();
    if (c != 0) {
      ctx->SetStatus(absl::Status(known_code(c), std::string(message.scalar<tstring>()())));
      return;
    }
    for (int i = 2; i < ctx->num_inputs(); ++i) ctx->set_output(i - 2, ctx->input(i));
  }
};

REGISTER_OP("RingreduceStatus")
    .Input("code: int32")
    .Input("message: string")
    .Input("values: T")
    .Output("outputs: T")
    .Attr("T: list(type) >= 0")
    .SetIsStateful()
    .SetShapeFn([](shape_inference::InferenceContext* c) {
      for (int i = 2; i < c->num_inputs(); ++i) c->set_output(i - 2, c->input(i));
      return absl::OkStatus();
    })
    .Doc("Its values, or the error (code, message) that a ringreduce collective reported.");

REGISTER_KERNEL_BUILDER(Name("RingreduceStatus").Device(DEVICE_CPU), RingreduceStatusOp);
