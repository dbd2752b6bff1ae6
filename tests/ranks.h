#pragma once
// Tests with several processes: a free port on 127.0.0.1, and this test
// program started again as the ranks of a job (torchrun's variables).

#include <gtest/gtest.h>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <spawn.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <torch/torch.h>

#include <fstream>
#include <iterator>
#include <map>
#include <string>
#include <vector>

extern char** environ;

namespace memfit {
namespace testing {

inline int free_port() {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  a.sin_port = 0;
  socklen_t len = sizeof(a);
  if (::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) != 0 ||
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) != 0) {
    ::close(fd);
    return 29500 + static_cast<int>(::getpid() % 1000);
  }
  const int port = ntohs(a.sin_port);
  ::close(fd);
  return port;
}

// Runs this test program's test `worker` (Suite.Name) as `n` ranks (torchrun's
// variables, one free port on 127.0.0.1) and returns their exit statuses.
inline std::vector<int> run_ranks(const std::string& worker, int n, const std::string& mode, const std::string& out) {
  const std::string port = std::to_string(free_port());
  std::vector<pid_t> pids;
  for (int r = 0; r < n; ++r) {
    std::vector<std::string> env_strings;
    for (char** e = environ; *e != nullptr; ++e) env_strings.emplace_back(*e);
    for (const auto& kv : std::map<std::string, std::string>{{"RANK", std::to_string(r)},
                                                             {"WORLD_SIZE", std::to_string(n)},
                                                             {"LOCAL_RANK", std::to_string(r)},
                                                             {"MASTER_ADDR", "127.0.0.1"},
                                                             {"MASTER_PORT", port},
                                                             {"MEMFIT_TEST_WORKER", mode},
                                                             {"MEMFIT_TEST_OUT", out},
                                                             {"OMP_NUM_THREADS", "1"}}) {
      env_strings.push_back(kv.first + "=" + kv.second);
    }
    std::vector<char*> envp;
    for (auto& s : env_strings) envp.push_back(s.data());
    envp.push_back(nullptr);
    std::string exe = "/proc/self/exe", filter = "--gtest_filter=" + worker;
    char* argv[] = {exe.data(), filter.data(), nullptr};
    pid_t pid = 0;
    EXPECT_EQ(::posix_spawn(&pid, exe.c_str(), nullptr, nullptr, argv, envp.data()), 0);
    pids.push_back(pid);
  }
  std::vector<int> statuses;
  for (pid_t pid : pids) {
    int status = 0;
    ::waitpid(pid, &status, 0);
    statuses.push_back(WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status));
  }
  return statuses;
}

// What rank `r` saved to `out`.rank`r`.pt (torch::save of a tensor list).
inline std::vector<torch::Tensor> load_rank(const std::string& out, int r) {
  std::vector<torch::Tensor> v;
  torch::load(v, out + ".rank" + std::to_string(r) + ".pt");
  return v;
}

// The whole text of the file at `path` (what a rank wrote, e.g. its error).
inline std::string read_text(const std::string& path) {
  std::ifstream in(path);
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

} // namespace testing
} // namespace memfit
