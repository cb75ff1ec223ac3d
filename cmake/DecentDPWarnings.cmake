# Warnings and sanitizers for the project's own targets.
function(decent_dp_target_defaults target)
  target_compile_options(${target} PRIVATE -Wall -Wextra -Wno-unused-parameter)
  # fmt is used header-only: LibTorch ships its own fmt headers, so linking a compiled
  # fmt of another version would mix two ABIs.
  target_compile_definitions(${target} PRIVATE FMT_HEADER_ONLY=1)
  if(DECENT_DP_SANITIZE)
    string(REPLACE ";" "," _san "${DECENT_DP_SANITIZE}")
    target_compile_options(${target} PRIVATE -fsanitize=${_san} -fno-omit-frame-pointer)
    target_link_options(${target} PRIVATE -fsanitize=${_san})
    if("thread" IN_LIST DECENT_DP_SANITIZE)
      # GCC's target_clones resolvers run before the TSan runtime is initialised.
      target_compile_definitions(${target} PRIVATE DECENT_DP_NO_MULTIVERSION=1)
    endif()
  endif()
endfunction()
