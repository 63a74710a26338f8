# The CMake machinery of the generated CMakeLists.txt: toolchain, system libraries, LibTorch, and
# the functions each BUILD rule kind becomes (stowage_cc_library, stowage_cc_binary,
# stowage_cc_test, the protoc.bzl macros, stowage_sh_test). Hand-written: it says how to build a
# rule, never which rules exist (deploy/cmake/gen_cmakelists.py writes those from the BUILD files).
# Included by CMakeLists.txt right after project().

set(CMAKE_CXX_STANDARD 17)
set(CMAKE_CXX_STANDARD_REQUIRED ON)
set(CMAKE_CXX_EXTENSIONS OFF)
set(CMAKE_EXPORT_COMPILE_COMMANDS ON)
get_property(_stowage_multi_config GLOBAL PROPERTY GENERATOR_IS_MULTI_CONFIG)
if(NOT CMAKE_BUILD_TYPE AND NOT _stowage_multi_config)
  set(CMAKE_BUILD_TYPE Release CACHE STRING "Build type" FORCE)
endif()

set(STOWAGE_DEPS_PREFIX "" CACHE PATH
    "Prefix with unpacked Debian packages (usr/include, usr/lib/<multiarch>, usr/bin); empty: the system")
set(STOWAGE_CUDA "AUTO" CACHE STRING
    "AUTO: define STOWAGE_WITH_CUDA when LibTorch has CUDA; ON: require a CUDA LibTorch; OFF: never")
set_property(CACHE STOWAGE_CUDA PROPERTY STRINGS AUTO ON OFF)
option(STOWAGE_BUILD_TESTS "Build the cc_test targets and register them with CTest" ON)
option(STOWAGE_BUILD_MANUAL "Build the targets Bazel tags manual: the libFuzzer binaries of tests/fuzz (clang only)" OFF)

enable_testing()
find_package(Threads REQUIRED)

# ------------------------------------------------------------------------------------------------
# System libraries: third_party/system.BUILD, as link-flag-only interface targets (same -l lists).
# ------------------------------------------------------------------------------------------------

if(CMAKE_LIBRARY_ARCHITECTURE)
  set(_stowage_multiarch "${CMAKE_LIBRARY_ARCHITECTURE}")
else()
  set(_stowage_multiarch "x86_64-linux-gnu")
endif()

# Everything linking a system library goes through stowage_sys_paths: it adds the prefix's include
# and library directories when STOWAGE_DEPS_PREFIX is set.
add_library(stowage_sys_paths INTERFACE)
set(STOWAGE_DEPS_LIB_DIR "")
if(STOWAGE_DEPS_PREFIX)
  get_filename_component(STOWAGE_DEPS_PREFIX "${STOWAGE_DEPS_PREFIX}" ABSOLUTE)
  set(STOWAGE_DEPS_INCLUDE_DIR "${STOWAGE_DEPS_PREFIX}/usr/include")
  set(STOWAGE_DEPS_LIB_DIR "${STOWAGE_DEPS_PREFIX}/usr/lib/${_stowage_multiarch}")
  foreach(_dir IN ITEMS "${STOWAGE_DEPS_INCLUDE_DIR}" "${STOWAGE_DEPS_LIB_DIR}")
    if(NOT IS_DIRECTORY "${_dir}")
      message(FATAL_ERROR "STOWAGE_DEPS_PREFIX=${STOWAGE_DEPS_PREFIX}: ${_dir} does not exist. "
                          "Unpack the packages with `dpkg -x <pkg>.deb ${STOWAGE_DEPS_PREFIX}`.")
    endif()
  endforeach()
  if(NOT EXISTS "${STOWAGE_DEPS_INCLUDE_DIR}/grpcpp/grpcpp.h")
    message(FATAL_ERROR "STOWAGE_DEPS_PREFIX=${STOWAGE_DEPS_PREFIX}: no grpcpp/grpcpp.h under "
                        "${STOWAGE_DEPS_INCLUDE_DIR} (is libgrpc++-dev unpacked there?)")
  endif()
  # SYSTEM: searched before /usr/include, so the prefix's protobuf headers win over a host copy.
  target_include_directories(stowage_sys_paths SYSTEM INTERFACE "${STOWAGE_DEPS_INCLUDE_DIR}")
  target_link_directories(stowage_sys_paths INTERFACE "${STOWAGE_DEPS_LIB_DIR}")
  # rpath-link: the linker resolves the libraries' own dependencies (libgrpc -> libre2, ...) there.
  # (CMake puts link directories into the build tree's RPATH itself, so the binaries find the
  # prefix's libraries at run time; LD_LIBRARY_PATH still takes precedence over RUNPATH.)
  target_link_options(stowage_sys_paths INTERFACE "LINKER:-rpath-link,${STOWAGE_DEPS_LIB_DIR}")
  message(STATUS "Stowage: system libraries from ${STOWAGE_DEPS_PREFIX}")
else()
  message(STATUS "Stowage: system libraries from the system")
endif()

add_library(stowage_sys_absl INTERFACE)
target_link_libraries(stowage_sys_absl INTERFACE stowage_sys_paths
  -labsl_statusor
  -labsl_status
  -labsl_cord
  -labsl_cordz_info
  -labsl_cord_internal
  -labsl_cordz_functions
  -labsl_cordz_handle
  -labsl_str_format_internal
  -labsl_strings
  -labsl_strings_internal
  -labsl_synchronization
  -labsl_time
  -labsl_time_zone
  -labsl_int128
  -labsl_raw_logging_internal
  -labsl_throw_delegate
  -labsl_base
  -labsl_spinlock_wait
  -labsl_stacktrace
  -labsl_symbolize
  -labsl_malloc_internal
  -labsl_debugging_internal
  -labsl_demangle_internal
  -labsl_graphcycles_internal
  -labsl_hash
  -labsl_city
  -labsl_low_level_hash
  -labsl_raw_hash_set
)

add_library(stowage_sys_absl_flags INTERFACE)
target_link_libraries(stowage_sys_absl_flags INTERFACE
  -labsl_flags_parse
  -labsl_flags_usage
  -labsl_flags_usage_internal
  -labsl_flags_internal
  -labsl_flags_marshalling
  -labsl_flags_reflection
  -labsl_flags_config
  -labsl_flags_program_name
  -labsl_flags_private_handle_accessor
  -labsl_flags_commandlineflag
  -labsl_flags_commandlineflag_internal
  stowage_sys_absl
)

add_library(stowage_sys_protobuf INTERFACE)
target_link_libraries(stowage_sys_protobuf INTERFACE -lprotobuf stowage_sys_absl)

add_library(stowage_sys_grpc INTERFACE)
target_link_libraries(stowage_sys_grpc INTERFACE
  -lgrpc++_reflection
  -lgrpc++
  -lgrpc
  -lgpr
  -labsl_synchronization
  stowage_sys_absl
  stowage_sys_protobuf
)

add_library(stowage_sys_prometheus INTERFACE)
target_link_libraries(stowage_sys_prometheus INTERFACE stowage_sys_paths
  -lprometheus-cpp-pull
  -lprometheus-cpp-core
)

add_library(stowage_sys_microhttpd INTERFACE)
target_link_libraries(stowage_sys_microhttpd INTERFACE stowage_sys_paths -lmicrohttpd)

add_library(stowage_sys_spdlog INTERFACE)
target_compile_definitions(stowage_sys_spdlog INTERFACE SPDLOG_SHARED_LIB SPDLOG_COMPILED_LIB SPDLOG_FMT_EXTERNAL)
target_link_libraries(stowage_sys_spdlog INTERFACE stowage_sys_paths -lspdlog -lfmt)

add_library(stowage_sys_xxhash INTERFACE)
target_link_libraries(stowage_sys_xxhash INTERFACE stowage_sys_paths -lxxhash)

add_library(stowage_sys_png INTERFACE)
target_link_libraries(stowage_sys_png INTERFACE stowage_sys_paths -lpng16 -lz)
add_library(stowage_sys_text INTERFACE)
target_link_libraries(stowage_sys_text INTERFACE stowage_sys_paths -lpcre2-8 -lutf8proc)

# libsentencepiece: only the tests' reference for models_t5_tokenizer; never link it with
# stowage_sys_protobuf (its bundled protobuf-lite clashes with libprotobuf in one process).
add_library(stowage_sys_sentencepiece INTERFACE)
target_link_libraries(stowage_sys_sentencepiece INTERFACE stowage_sys_paths -lsentencepiece_train -lsentencepiece)

add_library(stowage_sys_gtest INTERFACE)
target_link_libraries(stowage_sys_gtest INTERFACE stowage_sys_paths -lgmock -lgtest -lpthread)

# gmock_main names gmock and gtest again after itself: the archives are static, so a test whose
# helper library (linking stowage_sys_gtest) comes first on its link line would otherwise leave
# gmock_main's references to them unresolved.
add_library(stowage_sys_gtest_main INTERFACE)
target_link_libraries(stowage_sys_gtest_main INTERFACE -lgmock_main -lgmock -lgtest stowage_sys_gtest)

# ------------------------------------------------------------------------------------------------
# LibTorch: third_party/libtorch.bzl. find_package(Torch) replaces the cpu/cuda repository rule;
# STOWAGE_WITH_CUDA=1 is defined on everything that uses torch when LibTorch has CUDA, as the
# rule's cuda variant does.
# ------------------------------------------------------------------------------------------------

find_package(Torch REQUIRED)
set(_stowage_torch_cuda OFF)
if(TORCH_CUDA_LIBRARIES OR TARGET torch_cuda OR TARGET c10_cuda)
  set(_stowage_torch_cuda ON)
endif()
if(STOWAGE_CUDA STREQUAL "ON" AND NOT _stowage_torch_cuda)
  message(FATAL_ERROR "STOWAGE_CUDA=ON but the LibTorch found (${TORCH_INSTALL_PREFIX}) has no CUDA "
                      "(TORCH_CUDA_LIBRARIES is empty); point CMAKE_PREFIX_PATH at a CUDA LibTorch")
endif()
if(STOWAGE_CUDA STREQUAL "OFF")
  set(_stowage_torch_cuda OFF)
endif()
set(STOWAGE_WITH_CUDA ${_stowage_torch_cuda} CACHE INTERNAL "Whether STOWAGE_WITH_CUDA=1 is defined")

add_library(stowage_torch INTERFACE)
target_link_libraries(stowage_torch INTERFACE ${TORCH_LIBRARIES})
target_include_directories(stowage_torch SYSTEM INTERFACE ${TORCH_INCLUDE_DIRS})
if(TORCH_CXX_FLAGS)
  separate_arguments(_stowage_torch_cxx_flags UNIX_COMMAND "${TORCH_CXX_FLAGS}")
  target_compile_options(stowage_torch INTERFACE ${_stowage_torch_cxx_flags})
endif()
if(STOWAGE_WITH_CUDA)
  target_compile_definitions(stowage_torch INTERFACE STOWAGE_WITH_CUDA=1)
  # offload/cuda_backend.cc calls the CUDA runtime directly (libtorch.bzl: -lcudart, cuda_include).
  if(NOT TARGET CUDA::cudart)
    find_package(CUDAToolkit REQUIRED)
  endif()
  target_link_libraries(stowage_torch INTERFACE CUDA::cudart)
endif()
message(STATUS "Stowage: LibTorch ${Torch_VERSION} at ${TORCH_INSTALL_PREFIX}; "
               "STOWAGE_WITH_CUDA: ${STOWAGE_WITH_CUDA}")

# ------------------------------------------------------------------------------------------------
# Rule equivalents: cc_library, cc_binary, cc_test, and third_party/protoc.bzl's macros.
# ------------------------------------------------------------------------------------------------

# Every target includes from the repository root ("offload/module.h"), like Bazel's execroot.
# stowage_common comes first in every target's dependencies, so the prefix's include directory
# (through stowage_sys_paths) precedes LibTorch's: the pip LibTorch ships an older protobuf under
# torch/include/google/protobuf that must not shadow the protobuf the generated code was made for.
add_library(stowage_common INTERFACE)
target_include_directories(stowage_common INTERFACE "${CMAKE_CURRENT_SOURCE_DIR}")
target_compile_options(stowage_common INTERFACE -Wall)
target_link_libraries(stowage_common INTERFACE stowage_sys_paths Threads::Threads)

# A rule's linkopts: -l<lib> as libraries (they travel with a library to whatever links it, as in
# Bazel), anything else as link options.
function(_stowage_linkopts name scope)
  foreach(_opt IN LISTS ARGN)
    if(_opt MATCHES "^-l")
      target_link_libraries(${name} ${scope} ${_opt})
    else()
      target_link_options(${name} ${scope} ${_opt})
    endif()
  endforeach()
endfunction()

# stowage_cc_library(<package>_<name> SRCS <files relative to the repo root> DEPS <targets>
# [LINKOPTS ...])
function(stowage_cc_library name)
  cmake_parse_arguments(PARSE_ARGV 1 ARG "" "" "SRCS;DEPS;LINKOPTS")
  if(ARG_UNPARSED_ARGUMENTS)
    message(FATAL_ERROR "stowage_cc_library(${name}): unexpected arguments ${ARG_UNPARSED_ARGUMENTS}")
  endif()
  if(ARG_SRCS)
    add_library(${name} STATIC ${ARG_SRCS})
    target_link_libraries(${name} PUBLIC stowage_common ${ARG_DEPS})
    _stowage_linkopts(${name} PUBLIC ${ARG_LINKOPTS})
  else()  # Header-only cc_library.
    add_library(${name} INTERFACE)
    target_link_libraries(${name} INTERFACE stowage_common ${ARG_DEPS})
    _stowage_linkopts(${name} INTERFACE ${ARG_LINKOPTS})
  endif()
endfunction()

# stowage_cc_binary(<name> PACKAGE <package dir> SRCS ... DEPS ... [LINKOPTS ...]):
# build/<package>/<name>.
function(stowage_cc_binary name)
  cmake_parse_arguments(PARSE_ARGV 1 ARG "" "PACKAGE" "SRCS;DEPS;LINKOPTS")
  if(ARG_UNPARSED_ARGUMENTS OR NOT ARG_PACKAGE)
    message(FATAL_ERROR "stowage_cc_binary(${name}): needs PACKAGE, SRCS, DEPS")
  endif()
  add_executable(${name} ${ARG_SRCS})
  target_link_libraries(${name} PRIVATE stowage_common ${ARG_DEPS})
  _stowage_linkopts(${name} PRIVATE ${ARG_LINKOPTS})
  set_target_properties(${name} PROPERTIES RUNTIME_OUTPUT_DIRECTORY "${CMAKE_BINARY_DIR}/${ARG_PACKAGE}")
endfunction()

# Bazel runs a test with its runfiles: TEST_SRCDIR/TEST_WORKSPACE is the workspace root and
# TEST_TMPDIR a private writable directory. Mirror that so tests written for Bazel find their data.
set(STOWAGE_RUNFILES_DIR "${CMAKE_BINARY_DIR}/runfiles")
if(STOWAGE_BUILD_TESTS)
  file(MAKE_DIRECTORY "${STOWAGE_RUNFILES_DIR}")
  if(NOT EXISTS "${STOWAGE_RUNFILES_DIR}/stowage")
    file(CREATE_LINK "${CMAKE_CURRENT_SOURCE_DIR}" "${STOWAGE_RUNFILES_DIR}/stowage" SYMBOLIC)
  endif()
  # sh tests run from the build folder, which mirrors Bazel's runfiles root for binaries
  # (server/stowage_server, ...): link each fixture folder there too, so `tests/fixtures/<name>`
  # resolves the same under either build (a folder, not tests/fixtures itself: CMake puts
  # tests/fixtures' own test binary there).
  file(GLOB stowage_fixture_dirs LIST_DIRECTORIES true "${CMAKE_CURRENT_SOURCE_DIR}/tests/fixtures/*")
  foreach(fixture IN LISTS stowage_fixture_dirs)
    get_filename_component(fixture_name "${fixture}" NAME)
    if(IS_DIRECTORY "${fixture}" AND NOT EXISTS "${CMAKE_BINARY_DIR}/tests/fixtures/${fixture_name}")
      file(MAKE_DIRECTORY "${CMAKE_BINARY_DIR}/tests/fixtures")
      file(CREATE_LINK "${fixture}" "${CMAKE_BINARY_DIR}/tests/fixtures/${fixture_name}" SYMBOLIC)
    endif()
  endforeach()
endif()

# stowage_cc_test(<name> PACKAGE <package dir> [SIZE small|medium|large|enormous] SRCS ... DEPS ...
# [ARGS ...]): CTest name <package>/<name>, run from the repository root, with Bazel's timeout for
# the size (default medium, as in Bazel).
function(stowage_cc_test name)
  cmake_parse_arguments(PARSE_ARGV 1 ARG "" "PACKAGE;SIZE" "SRCS;DEPS;ARGS;LINKOPTS")
  if(ARG_UNPARSED_ARGUMENTS OR NOT ARG_PACKAGE)
    message(FATAL_ERROR "stowage_cc_test(${name}): needs PACKAGE, SRCS, DEPS")
  endif()
  if(NOT ARG_SIZE)
    set(ARG_SIZE medium)
  endif()
  set(_timeout_small 60)
  set(_timeout_medium 300)
  set(_timeout_large 900)
  set(_timeout_enormous 3600)
  if(NOT DEFINED _timeout_${ARG_SIZE})
    message(FATAL_ERROR "stowage_cc_test(${name}): SIZE must be small, medium, large or enormous")
  endif()
  if(NOT STOWAGE_BUILD_TESTS)
    return()
  endif()
  stowage_cc_binary(${name} PACKAGE ${ARG_PACKAGE} SRCS ${ARG_SRCS} DEPS ${ARG_DEPS} LINKOPTS ${ARG_LINKOPTS})
  set(_tmp "${CMAKE_BINARY_DIR}/testtmp/${ARG_PACKAGE}/${name}")
  file(MAKE_DIRECTORY "${_tmp}")
  add_test(NAME "${ARG_PACKAGE}/${name}" COMMAND ${name} ${ARG_ARGS}
           WORKING_DIRECTORY "${CMAKE_CURRENT_SOURCE_DIR}")
  set_tests_properties("${ARG_PACKAGE}/${name}" PROPERTIES
    TIMEOUT ${_timeout_${ARG_SIZE}}
    LABELS "${ARG_SIZE}"
    ENVIRONMENT "TEST_SRCDIR=${STOWAGE_RUNFILES_DIR};TEST_WORKSPACE=stowage;TEST_TMPDIR=${_tmp}")
endfunction()

# protoc and the plugins: the prefix's first (they must match its headers), then the system's.
if(STOWAGE_DEPS_PREFIX)
  set(_stowage_tool_hints HINTS "${STOWAGE_DEPS_PREFIX}/usr/bin")
endif()
find_program(STOWAGE_PROTOC protoc ${_stowage_tool_hints})
find_program(STOWAGE_GRPC_CPP_PLUGIN grpc_cpp_plugin ${_stowage_tool_hints})
find_program(STOWAGE_GRPC_PYTHON_PLUGIN grpc_python_plugin ${_stowage_tool_hints})
if(NOT STOWAGE_PROTOC)
  message(FATAL_ERROR "protoc not found: install protobuf-compiler, or unpack it into STOWAGE_DEPS_PREFIX")
endif()
if(NOT STOWAGE_GRPC_CPP_PLUGIN)
  message(FATAL_ERROR "grpc_cpp_plugin not found: install protobuf-compiler-grpc, or unpack it into "
                      "STOWAGE_DEPS_PREFIX (-DSTOWAGE_GRPC_CPP_PLUGIN=<path> to name it directly)")
endif()
# Tools unpacked into the prefix need its libraries (libprotoc.so.32, libgrpc_plugin_support).
set(_stowage_tool_env "")
if(STOWAGE_DEPS_LIB_DIR)
  if(DEFINED ENV{LD_LIBRARY_PATH} AND NOT "$ENV{LD_LIBRARY_PATH}" STREQUAL "")
    set(_stowage_tool_env "LD_LIBRARY_PATH=${STOWAGE_DEPS_LIB_DIR}:$ENV{LD_LIBRARY_PATH}")
  else()
    set(_stowage_tool_env "LD_LIBRARY_PATH=${STOWAGE_DEPS_LIB_DIR}")
  endif()
endif()
execute_process(COMMAND ${CMAKE_COMMAND} -E env ${_stowage_tool_env} "${STOWAGE_PROTOC}" --version
                OUTPUT_VARIABLE _stowage_protoc_version OUTPUT_STRIP_TRAILING_WHITESPACE
                RESULT_VARIABLE _stowage_protoc_rc)
if(NOT _stowage_protoc_rc EQUAL 0)
  message(FATAL_ERROR "${STOWAGE_PROTOC} --version failed (${_stowage_protoc_rc})")
endif()
# Generated code only compiles against the headers of the same protobuf minor version.
find_path(STOWAGE_PROTOBUF_INCLUDE_DIR google/protobuf/stubs/common.h
          HINTS ${STOWAGE_DEPS_INCLUDE_DIR} NO_CACHE)
if(STOWAGE_PROTOBUF_INCLUDE_DIR)
  file(STRINGS "${STOWAGE_PROTOBUF_INCLUDE_DIR}/google/protobuf/stubs/common.h" _stowage_pb_define
       REGEX "^#define GOOGLE_PROTOBUF_VERSION [0-9]+")
  string(REGEX MATCH "[0-9]+$" _stowage_pb_num "${_stowage_pb_define}")
  if(_stowage_pb_num)
    math(EXPR _stowage_pb_major "${_stowage_pb_num} / 1000000")
    math(EXPR _stowage_pb_minor "(${_stowage_pb_num} / 1000) % 1000")
    if(NOT _stowage_protoc_version MATCHES "^libprotoc ${_stowage_pb_major}\\.${_stowage_pb_minor}\\.|^libprotoc ${_stowage_pb_minor}\\.")
      message(FATAL_ERROR "${STOWAGE_PROTOC} is '${_stowage_protoc_version}' but the protobuf headers in "
                          "${STOWAGE_PROTOBUF_INCLUDE_DIR} are ${_stowage_pb_major}.${_stowage_pb_minor}; "
                          "pass -DSTOWAGE_PROTOC=<matching protoc>")
    endif()
  endif()
endif()
message(STATUS "Stowage: ${STOWAGE_PROTOC} (${_stowage_protoc_version}), ${STOWAGE_GRPC_CPP_PLUGIN}")
# Without a prefix, protobuf's headers are in a default directory (/usr/include), which the compiler
# searches after every -isystem directory, LibTorch's included. When LibTorch ships its own
# google/protobuf, put a directory holding only a link to the system's google/protobuf first.
get_filename_component(_stowage_torch_inc "${TORCH_INSTALL_PREFIX}/include" REALPATH)
get_filename_component(_stowage_pb_inc "${STOWAGE_PROTOBUF_INCLUDE_DIR}" REALPATH)
if(NOT STOWAGE_DEPS_PREFIX AND STOWAGE_PROTOBUF_INCLUDE_DIR AND
   EXISTS "${_stowage_torch_inc}/google/protobuf" AND NOT _stowage_torch_inc STREQUAL _stowage_pb_inc)
  set(_stowage_pb_shadow "${CMAKE_BINARY_DIR}/protobuf_include")
  file(MAKE_DIRECTORY "${_stowage_pb_shadow}/google")
  if(NOT EXISTS "${_stowage_pb_shadow}/google/protobuf")
    file(CREATE_LINK "${_stowage_pb_inc}/google/protobuf"
         "${_stowage_pb_shadow}/google/protobuf" SYMBOLIC)
  endif()
  target_include_directories(stowage_common SYSTEM BEFORE INTERFACE "${_stowage_pb_shadow}")
  message(STATUS "Stowage: LibTorch has its own google/protobuf headers; "
                 "${_stowage_pb_inc}/google/protobuf is searched first")
endif()

# Generated code goes to build/proto/stowage/v1/<file>.{pb,grpc.pb}.{h,cc}, included as
# "stowage/v1/<file>.pb.h", as third_party/protoc.bzl does under bazel-bin/proto.
set(STOWAGE_PROTO_ROOT "${CMAKE_CURRENT_SOURCE_DIR}/proto")
set(STOWAGE_PROTO_GEN_DIR "${CMAKE_BINARY_DIR}/proto")
set(_stowage_proto_paths "--proto_path=${STOWAGE_PROTO_ROOT}")
if(STOWAGE_PROTOBUF_INCLUDE_DIR AND EXISTS "${STOWAGE_PROTOBUF_INCLUDE_DIR}/google/protobuf/duration.proto")
  # Well-known types (google/protobuf/duration.proto) next to the headers they belong to.
  list(APPEND _stowage_proto_paths "--proto_path=${STOWAGE_PROTOBUF_INCLUDE_DIR}")
endif()

# stowage_cc_grpc_proto_library(<target> SRCS <paths under proto/> DEPS ...): protoc.bzl's
# cc_grpc_proto_library (one protoc run over all sources; a library of the generated code).
function(stowage_cc_grpc_proto_library name)
  cmake_parse_arguments(PARSE_ARGV 1 ARG "" "GRPC_INCLUDE" "SRCS;DEPS;CC_DEPS")
  set(_grpc_params "")
  if(ARG_GRPC_INCLUDE)
    set(_grpc_params "additional_header_includes=${ARG_GRPC_INCLUDE}:")
  endif()
  set(_inputs "")
  set(_outs "")
  set(_srcs "")
  foreach(_src IN LISTS ARG_SRCS)
    string(REGEX REPLACE "\\.proto$" "" _base "${_src}")
    list(APPEND _inputs "${STOWAGE_PROTO_ROOT}/${_src}")
    foreach(_ext IN ITEMS .pb.h .pb.cc .grpc.pb.h .grpc.pb.cc)
      list(APPEND _outs "${STOWAGE_PROTO_GEN_DIR}/${_base}${_ext}")
    endforeach()
    list(APPEND _srcs "${STOWAGE_PROTO_GEN_DIR}/${_base}.pb.cc" "${STOWAGE_PROTO_GEN_DIR}/${_base}.grpc.pb.cc")
  endforeach()
  file(MAKE_DIRECTORY "${STOWAGE_PROTO_GEN_DIR}")
  string(REPLACE ";" " " _stowage_comment "${ARG_SRCS}")
  add_custom_command(
    OUTPUT ${_outs}
    COMMAND ${CMAKE_COMMAND} -E env ${_stowage_tool_env}
            "${STOWAGE_PROTOC}" ${_stowage_proto_paths}
            "--cpp_out=${STOWAGE_PROTO_GEN_DIR}" "--grpc_out=${_grpc_params}${STOWAGE_PROTO_GEN_DIR}"
            "--plugin=protoc-gen-grpc=${STOWAGE_GRPC_CPP_PLUGIN}" ${_inputs}
    DEPENDS ${_inputs} "${STOWAGE_PROTOC}" "${STOWAGE_GRPC_CPP_PLUGIN}"
    COMMENT "protoc (C++ and gRPC) ${_stowage_comment}"
    VERBATIM)
  add_library(${name} STATIC ${_srcs})
  target_include_directories(${name} PUBLIC "${STOWAGE_PROTO_GEN_DIR}")
  target_link_libraries(${name} PUBLIC stowage_common ${ARG_DEPS} ${ARG_CC_DEPS} stowage_sys_grpc stowage_sys_protobuf)
endfunction()

# stowage_py_grpc_proto_library(<target> SRCS ...): protoc.bzl's py_grpc_proto_library
# (*_pb2.py and *_pb2_grpc.py in build/proto/stowage/v1/). Built by default when
# grpc_python_plugin is available; skipped with a message otherwise.
function(stowage_py_grpc_proto_library name)
  cmake_parse_arguments(PARSE_ARGV 1 ARG "" "" "SRCS")
  if(NOT STOWAGE_GRPC_PYTHON_PLUGIN)
    message(STATUS "Stowage: grpc_python_plugin not found; not generating ${name}")
    return()
  endif()
  set(_inputs "")
  set(_outs "")
  foreach(_src IN LISTS ARG_SRCS)
    string(REGEX REPLACE "\\.proto$" "" _base "${_src}")
    list(APPEND _inputs "${STOWAGE_PROTO_ROOT}/${_src}")
    list(APPEND _outs "${STOWAGE_PROTO_GEN_DIR}/${_base}_pb2.py" "${STOWAGE_PROTO_GEN_DIR}/${_base}_pb2_grpc.py")
  endforeach()
  file(MAKE_DIRECTORY "${STOWAGE_PROTO_GEN_DIR}")
  string(REPLACE ";" " " _stowage_comment "${ARG_SRCS}")
  add_custom_command(
    OUTPUT ${_outs}
    COMMAND ${CMAKE_COMMAND} -E env ${_stowage_tool_env}
            "${STOWAGE_PROTOC}" ${_stowage_proto_paths}
            "--python_out=${STOWAGE_PROTO_GEN_DIR}" "--grpc_python_out=${STOWAGE_PROTO_GEN_DIR}"
            "--plugin=protoc-gen-grpc_python=${STOWAGE_GRPC_PYTHON_PLUGIN}" ${_inputs}
    DEPENDS ${_inputs} "${STOWAGE_PROTOC}" "${STOWAGE_GRPC_PYTHON_PLUGIN}"
    COMMENT "protoc (Python and gRPC) ${_stowage_comment}"
    VERBATIM)
  add_custom_target(${name} ALL DEPENDS ${_outs})
endfunction()

# sh_test targets: the script runs from the build directory, which holds the built binaries where
# Bazel's runfiles root does, with its own TEST_TMPDIR; size small (60 s) or medium (300 s); extra
# arguments are more NAME=VALUE environment entries.
function(stowage_sh_test package name size)
  if(NOT STOWAGE_BUILD_TESTS)
    return()
  endif()
  set(tmp "${CMAKE_BINARY_DIR}/testtmp/${package}/${name}")
  file(MAKE_DIRECTORY "${tmp}")
  add_test(NAME ${package}/${name}
           COMMAND bash "${CMAKE_CURRENT_SOURCE_DIR}/${package}/${name}.sh"
           WORKING_DIRECTORY "${CMAKE_BINARY_DIR}")
  if(size STREQUAL "small")
    set(timeout 60)
  else()
    set(timeout 300)
  endif()
  set(env "TEST_TMPDIR=${tmp}" ${ARGN})
  set_tests_properties(${package}/${name} PROPERTIES TIMEOUT ${timeout} LABELS ${size}
    ENVIRONMENT "${env}")
endfunction()
