# microd_add_gtest(NAME SOURCES... LIBS... [TIMEOUT S] [LABELS L...]): one
# GoogleTest binary per unit, registered with CTest test by test (LABELS:
# each of its tests labelled, e.g. `long`: make test-long's).
function(microd_add_gtest name)
  cmake_parse_arguments(ARG "" "TIMEOUT" "SOURCES;LIBS;LABELS" ${ARGN})
  if(NOT ARG_TIMEOUT)
    set(ARG_TIMEOUT 300)
  endif()
  add_executable(${name} ${ARG_SOURCES})
  target_link_libraries(${name} PRIVATE ${ARG_LIBS} GTest::gtest GTest::gtest_main microd_config)
  # tests/helper_path.h: the build tree the helpers' paths are compiled in.
  target_compile_definitions(${name} PRIVATE MICROD_BUILD_ROOT="${CMAKE_BINARY_DIR}")
  set(properties TIMEOUT ${ARG_TIMEOUT})
  if(ARG_LABELS)
    list(APPEND properties LABELS ${ARG_LABELS})
  endif()
  gtest_discover_tests(${name} DISCOVERY_TIMEOUT 60 PROPERTIES ${properties})
endfunction()
