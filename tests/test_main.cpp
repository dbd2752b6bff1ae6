// The test program's main: GoogleTest's, plus a stack trace on a crash.
//
// A test that dies on SIGSEGV, SIGBUS, SIGFPE or SIGILL prints the signal and
// the call stack (glibc's backtrace; the test program is linked with
// -rdynamic so its own frames have names) to stderr before it dies, so that a
// crash on a machine without a debugger says where it happened.

#include <gtest/gtest.h>

#include <signal.h>
#include <ucontext.h>
#include <cstring>
#include <execinfo.h>
#include <unistd.h>

namespace {

void say(const char* text) { (void)!write(STDERR_FILENO, text, std::strlen(text)); }

void print_stack_and_die(int signal_number, siginfo_t*, void* context) {
  // Only async-signal-safe calls: write and backtrace_symbols_fd.
  say("\n*** memfit_tests: fatal signal: ");
  say(strsignal(signal_number));
  say("\n");
#if defined(__x86_64__)
  // The faulting instruction and the return address on top of the stack:
  // when a call jumped to a bad address, the unwinder stops at the signal
  // frame and the second one still names the caller.
  const auto* uc = static_cast<const ucontext_t*>(context);
  void* where[2] = {reinterpret_cast<void*>(uc->uc_mcontext.gregs[REG_RIP]),
                    *reinterpret_cast<void* const*>(uc->uc_mcontext.gregs[REG_RSP])};
  say("faulting instruction, then the address on top of the stack:\n");
  backtrace_symbols_fd(where, 2, STDERR_FILENO);
#else
  (void)context;
#endif
  say("call stack:\n");
  void* frames[64];
  const int n = backtrace(frames, 64);
  backtrace_symbols_fd(frames, n, STDERR_FILENO);
  signal(signal_number, SIG_DFL);
  raise(signal_number);
}

} // namespace

int main(int argc, char** argv) {
  void* warm[1];
  backtrace(warm, 1);  // loads libgcc before any crash: backtrace may allocate the first time
  struct sigaction action {};
  action.sa_sigaction = print_stack_and_die;
  action.sa_flags = SA_SIGINFO;
  sigemptyset(&action.sa_mask);
  for (int s : {SIGSEGV, SIGBUS, SIGFPE, SIGILL}) sigaction(s, &action, nullptr);
  testing::InitGoogleTest(&argc, argv);
  return RUN_ALL_TESTS();
}
