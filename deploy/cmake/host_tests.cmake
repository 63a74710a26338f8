# CMake-only registrations that depend on the host: what a BUILD rule cannot say for a CMake build
# (the CUDA compiler, interpreters and tools that may be missing, LibTorch's version). Each rule here
# is named in deploy/cmake/gen_cmakelists.py's HOST_SPECIFIC table, which keeps the generator from
# registering it a second time and fails when a name here is no longer a BUILD rule. Included by
# CMakeLists.txt after every generated target.

# The genrule :fused_kernels_o of models/core/BUILD: the CUDA kernels, compiled by nvcc for sm_90
# in CUDA builds only.
# Its own object library: none of the C++ targets' flags (-Wall, LibTorch's) reach nvcc.
if(STOWAGE_WITH_CUDA)
  if(NOT CMAKE_CUDA_COMPILER)
    if(CUDAToolkit_NVCC_EXECUTABLE)
      set(CMAKE_CUDA_COMPILER "${CUDAToolkit_NVCC_EXECUTABLE}")
    elseif(EXISTS /usr/local/cuda/bin/nvcc)
      set(CMAKE_CUDA_COMPILER /usr/local/cuda/bin/nvcc)
    endif()
  endif()
  enable_language(CUDA)
  add_library(models_core_fused_kernels_cuda OBJECT models/core/fused_kernels.cu)
  target_include_directories(models_core_fused_kernels_cuda PRIVATE "${CMAKE_CURRENT_SOURCE_DIR}")
  set_target_properties(models_core_fused_kernels_cuda PROPERTIES
    CUDA_ARCHITECTURES 90 POSITION_INDEPENDENT_CODE ON CUDA_STANDARD 17)
  target_compile_options(models_core_fused_kernels_cuda PRIVATE -O3)
  target_sources(models_core_fused_ops PRIVATE $<TARGET_OBJECTS:models_core_fused_kernels_cuda>)
  # The genrule :widen_kernels_o of offload/BUILD, the same way.
  add_library(offload_widen_kernels_cuda OBJECT offload/widen_kernels.cu)
  target_include_directories(offload_widen_kernels_cuda PRIVATE "${CMAKE_CURRENT_SOURCE_DIR}")
  set_target_properties(offload_widen_kernels_cuda PROPERTIES
    CUDA_ARCHITECTURES 90 POSITION_INDEPENDENT_CODE ON CUDA_STANDARD 17)
  target_compile_options(offload_widen_kernels_cuda PRIVATE -O3)
  target_sources(offload_compression PRIVATE $<TARGET_OBJECTS:offload_widen_kernels_cuda>)
endif()

# Bazel gives the server the demo pipeline's folder as runfiles (data = //models/demo:shapes); a
# CMake build finds it in the source tree.
target_compile_definitions(stowage_server PRIVATE "STOWAGE_SOURCE_DIR=\"${CMAKE_SOURCE_DIR}\"")

# sh_tests over the Python client. Bazel runs them from the runfiles root, where server/,
# clients/stowctl/ and proto/ hold the built outputs and clients/python/, tests/e2e/ the sources;
# the build directory has the same layout once the two source folders are linked into it. They use
# Debian's /usr/bin/python3 with python3-grpcio and python3-protobuf, so they are registered only
# where that interpreter has grpc and protobuf and grpc_python_plugin made the stubs.
set(STOWAGE_SYSTEM_PYTHON "/usr/bin/python3" CACHE FILEPATH "Python the sh_tests run (as Bazel's do)")
set(_stowage_py_tests OFF)
if(STOWAGE_BUILD_TESTS AND TARGET proto_stowage_py_proto AND EXISTS "${STOWAGE_SYSTEM_PYTHON}")
  execute_process(COMMAND "${STOWAGE_SYSTEM_PYTHON}" -c "import grpc, google.protobuf"
                  RESULT_VARIABLE _stowage_py_rc OUTPUT_QUIET ERROR_QUIET)
  if(_stowage_py_rc EQUAL 0)
    set(_stowage_py_tests ON)
  endif()
endif()
if(_stowage_py_tests)
  file(MAKE_DIRECTORY "${CMAKE_BINARY_DIR}/clients" "${CMAKE_BINARY_DIR}/tests/e2e")
  foreach(_link IN ITEMS clients/python tests/e2e/python_e2e_test.py)
    if(NOT EXISTS "${CMAKE_BINARY_DIR}/${_link}")
      file(CREATE_LINK "${CMAKE_CURRENT_SOURCE_DIR}/${_link}" "${CMAKE_BINARY_DIR}/${_link}" SYMBOLIC)
    endif()
  endforeach()
  # clients/python/BUILD: client_test
  add_test(NAME clients/python/client_test
           COMMAND bash "${CMAKE_CURRENT_SOURCE_DIR}/clients/python/run_tests.sh" proto
           WORKING_DIRECTORY "${CMAKE_BINARY_DIR}")
  set_tests_properties(clients/python/client_test PROPERTIES TIMEOUT 60 LABELS small)
  # tests/e2e/BUILD: python_e2e_test
  add_test(NAME tests/e2e/python_e2e_test
           COMMAND bash "${CMAKE_CURRENT_SOURCE_DIR}/tests/e2e/python_e2e_test.sh"
           WORKING_DIRECTORY "${CMAKE_BINARY_DIR}")
  set_tests_properties(tests/e2e/python_e2e_test PROPERTIES TIMEOUT 300 LABELS medium)
  # tests/e2e/BUILD: demo_e2e_test (also needs numpy and PIL to score the images).
  execute_process(COMMAND "${STOWAGE_SYSTEM_PYTHON}" -c "import numpy, PIL"
                  RESULT_VARIABLE _stowage_demo_rc OUTPUT_QUIET ERROR_QUIET)
  if(_stowage_demo_rc EQUAL 0)
    file(MAKE_DIRECTORY "${CMAKE_BINARY_DIR}/models")
    foreach(_link IN ITEMS models/demo tests/e2e/demo_e2e_test.py)
      if(NOT EXISTS "${CMAKE_BINARY_DIR}/${_link}")
        file(CREATE_LINK "${CMAKE_CURRENT_SOURCE_DIR}/${_link}" "${CMAKE_BINARY_DIR}/${_link}" SYMBOLIC)
      endif()
    endforeach()
    add_test(NAME tests/e2e/demo_e2e_test
             COMMAND bash "${CMAKE_CURRENT_SOURCE_DIR}/tests/e2e/demo_e2e_test.sh"
             WORKING_DIRECTORY "${CMAKE_BINARY_DIR}")
    set_tests_properties(tests/e2e/demo_e2e_test PROPERTIES TIMEOUT 300 LABELS medium)
  endif()
else()
  message(STATUS "Stowage: not registering the Python sh_tests (client_test, python_e2e_test): "
                 "they need ${STOWAGE_SYSTEM_PYTHON} with grpc and protobuf, and grpc_python_plugin")
endif()

# The drift check itself (Bazel: a py_test over the BUILD files and this file).
find_package(Python3 COMPONENTS Interpreter)
if(STOWAGE_BUILD_TESTS AND Python3_Interpreter_FOUND)
  add_test(NAME tests/build_parity_test
           COMMAND "${Python3_EXECUTABLE}" "${CMAKE_CURRENT_SOURCE_DIR}/tests/build_parity_test.py")
  set_tests_properties(tests/build_parity_test PROPERTIES
    ENVIRONMENT "STOWAGE_SRC_ROOT=${CMAKE_CURRENT_SOURCE_DIR}")
  add_test(NAME tests/layering_test
           COMMAND "${Python3_EXECUTABLE}" "${CMAKE_CURRENT_SOURCE_DIR}/tests/layering_test.py")
  set_tests_properties(tests/layering_test PROPERTIES
    ENVIRONMENT "STOWAGE_SRC_ROOT=${CMAKE_CURRENT_SOURCE_DIR}")
endif()

# tests/BUILD: launcher_cuda_route_test (the launcher script is in the source tree).
stowage_sh_test(tests launcher_cuda_route_test small "STOWAGE_LAUNCHER=${CMAKE_CURRENT_SOURCE_DIR}/stowage")

# tests/e2e/BUILD: openai_sdk_e2e_test (npm's openai against the server; needs node, npm and the npm
# registry, so it is registered only where npm exists).
find_program(STOWAGE_NPM npm)
if(STOWAGE_NPM)
  stowage_sh_test(tests/e2e openai_sdk_e2e_test medium)
endif()

# tests/parity/BUILD: zimage_parity_test (the C++ Z-Image components against the committed fixtures).
if(Torch_VERSION VERSION_GREATER_EQUAL "2.0")
  set(stowage_parity_bf16 "1e-2")  # Same LibTorch kernels as the reference's torch.
else()
  set(stowage_parity_bf16 "3e-2")
endif()
stowage_sh_test(tests/parity zimage_parity_test small
  "STOWAGE_FIXTURES=${CMAKE_CURRENT_SOURCE_DIR}/tests/fixtures/zimage_tiny"
  "STOWAGE_PARITY_BF16_TOLERANCE=${stowage_parity_bf16}")
# tests/parity/BUILD: flux_parity_test (the C++ Flux.1 components and tokenizers against their fixtures).
stowage_sh_test(tests/parity flux_parity_test small
  "STOWAGE_FIXTURES=${CMAKE_CURRENT_SOURCE_DIR}/tests/fixtures/flux_tiny"
  "STOWAGE_PARITY_BF16_TOLERANCE=${stowage_parity_bf16}")
