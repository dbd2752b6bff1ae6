#include "launch.h"
#include "usage.h"

#include <fmt/format.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <csignal>
#include <cstdlib>
#include <map>
#include <thread>

#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

namespace memfit::tools {

void add_launch_command(CLI::App& app, LaunchArgs& a) {
  auto* launch = app.add_subcommand(
      "launch",
      "Start --nproc worker processes of a data-parallel job with torchrun's variables (RANK, "
      "WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT), e.g. `memfit launch --nproc 2 -- memfit "
      "train --model mlp`; each worker gets OMP_NUM_THREADS = this machine's hardware threads / "
      "--nproc (at least 1) unless it is set; when one worker fails the others are stopped and its "
      "exit status is returned");
  launch->add_option("--nproc", a.nproc, "Worker processes on this machine")
      ->required()
      ->check(integer(1, 1024));
  launch->add_option("--nnodes", a.nnodes, "Machines in the job (each runs memfit launch)")
      ->check(integer(1, 65536))
      ->capture_default_str();
  launch->add_option("--node-rank", a.node_rank, "This machine's index, 0..nnodes-1")
      ->check(integer(0, 65535))
      ->capture_default_str();
  launch->add_option("--master-addr", a.master_addr, "Address of the machine with node rank 0")
      ->capture_default_str();
  launch->add_option("--master-port", a.master_port, "Port of rank 0's TCPStore there")
      ->check(integer(1, 65535))
      ->capture_default_str();
  launch->add_option("--grace", a.grace,
                     "Seconds the other workers get to exit after one failed, before SIGKILL")
      ->check(real(0, 3600))
      ->capture_default_str();
  launch->add_option("command", a.command, "The worker's command line, after --")->required();
}

namespace {

// The signal the launcher received (SIGINT, SIGTERM or SIGHUP), 0 if none.
volatile std::sig_atomic_t g_signal = 0;

void on_signal(int sig) { g_signal = sig; }

// Sends `sig` to every worker's process group: a worker started through a
// shell takes its children with it.
void signal_groups(const std::map<pid_t, int64_t>& rank_of, int sig) {
  for (const auto& [pid, rank] : rank_of) ::kill(-pid, sig);
}

// In a forked child: the worker's environment (torchrun's variables), then
// its command; never returns.
[[noreturn]] void exec_worker(const LaunchArgs& a, int64_t rank, int64_t local, const std::string& omp_threads) {
  ::setpgid(0, 0);                     // its own process group, ended as a whole
  ::prctl(PR_SET_PDEATHSIG, SIGKILL);  // and killed if the launcher is
  if (::getppid() == 1) std::_Exit(128 + SIGKILL);  // the launcher died before prctl
  ::setenv("RANK", std::to_string(rank).c_str(), 1);
  ::setenv("WORLD_SIZE", std::to_string(a.nproc * a.nnodes).c_str(), 1);
  ::setenv("LOCAL_RANK", std::to_string(local).c_str(), 1);
  ::setenv("LOCAL_WORLD_SIZE", std::to_string(a.nproc).c_str(), 1);
  ::setenv("MASTER_ADDR", a.master_addr.c_str(), 1);
  ::setenv("MASTER_PORT", std::to_string(a.master_port).c_str(), 1);
  ::setenv("OMP_NUM_THREADS", omp_threads.c_str(), 0);  // the user's own setting stays
  std::vector<char*> argv;
  std::vector<std::string> copy = a.command;
  for (auto& s : copy) argv.push_back(s.data());
  argv.push_back(nullptr);
  ::execvp(argv[0], argv.data());
  fmt::print(stderr, "memfit launch: error: could not run '{}' for rank {}: {}\n", a.command.front(), rank,
             std::strerror(errno));
  std::_Exit(127);
}

// Forks this machine's --nproc workers; each worker's pid maps to its rank
// (empty: a fork failed, and those started were killed).
std::map<pid_t, int64_t> start_workers(const LaunchArgs& a) {
  // The cores shared out, as torchrun does (it gives each worker 1): OpenMP
  // threads spin, and workers of every core each slow one another down 5x.
  const int64_t hw = std::max(1u, std::thread::hardware_concurrency());
  const std::string omp_threads = std::to_string(std::max<int64_t>(1, hw / a.nproc));
  std::map<pid_t, int64_t> rank_of;
  std::fflush(stdout);
  std::fflush(stderr);
  for (int64_t local = 0; local < a.nproc; ++local) {
    const int64_t rank = a.node_rank * a.nproc + local;
    const pid_t pid = ::fork();
    if (pid < 0) {
      fmt::print(stderr, "memfit launch: error: could not start worker {}: fork failed\n", rank);
      for (const auto& [p, r] : rank_of) ::kill(p, SIGKILL);
      return {};
    }
    if (pid == 0) exec_worker(a, rank, local, omp_threads);
    ::setpgid(pid, pid);  // also here: no signal may reach the group before it exists
    rank_of[pid] = rank;
  }
  return rank_of;
}

// Waits for every worker: the first that fails, or a signal to the
// launcher, stops the others (SIGTERM, or the signal; SIGKILL after
// --grace seconds). Returns the launch's exit status.
int supervise(std::map<pid_t, int64_t> rank_of, double grace) {
  int result = 0;
  bool stopping = false;
  auto deadline = std::chrono::steady_clock::time_point::max();
  const auto stop_by = [&] {
    return std::chrono::steady_clock::now() + std::chrono::milliseconds(static_cast<int64_t>(grace * 1000));
  };
  while (!rank_of.empty()) {
    if (const int sig = g_signal; sig != 0 && !stopping) {
      stopping = true;
      result = 128 + sig;
      fmt::print(stderr, "memfit launch: received signal {}; passing it to the {} worker{}\n", sig,
                 rank_of.size(), rank_of.size() == 1 ? "" : "s");
      signal_groups(rank_of, sig);
      deadline = stop_by();
    }
    int status = 0;
    // Polled: a signal that lands just before a blocking wait would be seen
    // only when a worker ends on its own.
    const pid_t pid = ::waitpid(-1, &status, WNOHANG);
    if (pid > 0) {
      const int64_t rank = rank_of[pid];
      rank_of.erase(pid);
      const int code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
      if (code != 0 && !stopping) {
        result = code;
        stopping = true;
        fmt::print(stderr, "memfit launch: rank {} {} {}; stopping the other {} worker{}\n", rank,
                   WIFEXITED(status) ? "exited with status" : "was killed by signal",
                   WIFEXITED(status) ? code : WTERMSIG(status), rank_of.size(),
                   rank_of.size() == 1 ? "" : "s");
        signal_groups(rank_of, SIGTERM);
        deadline = stop_by();
      }
      continue;
    }
    if (pid < 0 && errno != EINTR) break;
    if (stopping && std::chrono::steady_clock::now() >= deadline) {
      signal_groups(rank_of, SIGKILL);
      deadline = std::chrono::steady_clock::time_point::max();
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return result;
}

}  // namespace

int run_launch(const LaunchArgs& a) {
  if (a.node_rank >= a.nnodes) {
    fmt::print(stderr, "memfit launch: error: --node-rank {} is not below --nnodes {}\n", a.node_rank,
               a.nnodes);
    return 2;
  }
  // SIGINT, SIGTERM and SIGHUP are forwarded to every worker's group, from
  // before the first fork: a signal while workers start still reaches them
  // (a worker's exec restores the default actions).
  struct sigaction action {};
  action.sa_handler = on_signal;
  sigemptyset(&action.sa_mask);
  for (int sig : {SIGINT, SIGTERM, SIGHUP}) ::sigaction(sig, &action, nullptr);
  const auto rank_of = start_workers(a);
  if (rank_of.empty()) return 1;
  const int result = supervise(rank_of, a.grace);
  // No process outlives the launcher: what a worker left in its group (a
  // shell's background children) goes with it.
  for (const auto& [group, rank] : rank_of) ::kill(-group, SIGKILL);
  return result;
}

} // namespace memfit::tools
